"""specdec.runtime.limits: token bucket, per-tenant slots, the total bound, message caps."""
from __future__ import annotations

import pytest

from specdec.runtime.errors import ResourceExhausted
from specdec.runtime.limits import TenantQuota, TenantLimits, TokenBucket, model_message_caps


def test_token_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0, stamp=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.4) is False  # 0.8 tokens
    assert bucket.take(0.5) is True  # 1.0
    assert bucket.take(100.0) and bucket.tokens == pytest.approx(2.0)  # capped at burst, minus one


def test_slots_per_tenant_and_in_total() -> None:
    admission = TenantQuota(TenantLimits(max_streams_per_tenant=2, max_in_flight=3,
                                          rate_per_tenant=0))
    with admission.enter("a"), admission.enter("a"):
        with pytest.raises(ResourceExhausted, match="^max_streams_per_tenant:"):
            with admission.enter("a"):
                pass
        with admission.enter("b"):
            with pytest.raises(ResourceExhausted, match="^max_in_flight:"):
                with admission.enter("c"):
                    pass
    assert admission.in_flight == 0
    with admission.enter("a"), admission.enter("a"):  # slots came back
        pass


def test_request_bytes() -> None:
    admission = TenantQuota(TenantLimits(max_request_bytes=10))
    admission.check_bytes(10)
    with pytest.raises(ResourceExhausted, match="^max_request_bytes:"):
        admission.check_bytes(11)


def test_message_caps_follow_the_model() -> None:
    receive, send = model_message_caps(vocab=49_152, max_k=16, max_request_tokens=8192)
    assert send >= 17 * 49_152 * 4 and send < 5 << 20
    assert 8192 * 10 <= receive < 1 << 20



def test_a_call_of_n_streams_holds_n_slots() -> None:
    quota = TenantQuota(TenantLimits(max_streams_per_tenant=4, max_in_flight=6, rate_per_tenant=0))
    with pytest.raises(ResourceExhausted, match=r"^max_streams_per_tenant: .*\(this call runs 5 streams\)"):
        with quota.enter("a", streams=5):
            pass
    with quota.enter("a", streams=3):
        with pytest.raises(ResourceExhausted, match="^max_streams_per_tenant:"):
            with quota.enter("a", streams=2):
                pass
        with quota.enter("b", streams=3):
            with pytest.raises(ResourceExhausted, match="^max_in_flight:"):
                with quota.enter("c"):
                    pass
    assert quota.in_flight == 0 and not quota._streams

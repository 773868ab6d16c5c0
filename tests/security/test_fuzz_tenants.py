"""The fuzz on the authenticated path, with every per-tenant limit on (real processes).

tests/security/test_fuzz.py fuzzes one token-less tenant with the rate and stream limits off. Here
the orchestrator requires tokens (tenants alice and bob) and keeps small limits: 20 calls a second
(burst 10), 2 streams per tenant, 2 kept sessions, half the 4 target slots per tenant. Each example
sends a burst of 3 concurrent Generates of random fields (test_fuzz's strategy) under a random
credential: none, a malformed header, a token nobody holds, or a tenant's. Only documented
statuses may come back (never UNKNOWN or INTERNAL, nor an exception's name), the limits are each
hit, and afterwards each tenant's reference request still returns the same text.
"""
from __future__ import annotations

import collections
import concurrent.futures

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import build_request
from specdec.v1 import orchestrator_pb2 as pb
from tests.integration.stack import Stack
from tests.security.test_fuzz import SCALE, generate_request

TOKENS = {"alice": "alice-fuzz-token-0123456789", "bob": "bob-fuzz-token-0123456789"}
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.PERMISSION_DENIED}
SEEN: collections.Counter = collections.Counter()
LIMITS = ("rate_per_tenant", "max_streams_per_tenant", "max_kept_sessions_per_tenant")
HIT: collections.Counter = collections.Counter()
EXAMPLES = max(1, int(120 * SCALE))
credentials = st.sampled_from([None, "Basic YWxpY2U6eA==", "Bearer nobodys-token", "Bearer ",
                               f"Bearer {TOKENS['alice']}", f"Bearer {TOKENS['alice']}",
                               f"Bearer {TOKENS['bob']}"])


@pytest.fixture(scope="module")
def tenants_stack(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    logs = tmp_path_factory.mktemp("fuzz-tenants")
    (logs / "tokens").write_text("".join(f"{t}:{k}\n" for t, k in TOKENS.items()))
    s = Stack(logs=logs)
    try:
        s.start_service("target", "target", target_dir, register=False)
        s.start_service("draft", "draft", draft_dir, register=False)
        s.start_orchestrator("orch", target_dir, targets=[s.addresses["target"]], drafts=[s.addresses["draft"]],
                             extra=("--auth-tokens", str(logs / "tokens"), "--rate-per-tenant", "20",
                                    "--burst-per-tenant", "10", "--max-streams-per-tenant", "2",
                                    "--max-kept-sessions-per-tenant", "2", "--target-capacity", "4",
                                    "--tenant-share", "0.5", "--max-new-tokens-limit", "24"))
        with grpc.insecure_channel(s.addresses["orch"]) as channel:
            yield channel
    finally:
        s.stop()


def _call(channel, msg: pb.GenerateRequest, authorization: str | None) -> grpc.StatusCode:
    metadata = (("authorization", authorization),) if authorization is not None else None
    try:
        for _ in channel.unary_stream("/specdec.v1.Orchestrator/Generate")(
                msg.SerializeToString(), timeout=60, metadata=metadata):
            pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        details = exc.details() or ""
        assert code in ALLOWED, f"{code.name}: {details}"
        assert "Error" not in details, details  # no exception class names
        HIT.update(limit for limit in LIMITS if details.startswith(limit + ":"))
    SEEN[code.name] += 1
    return code


def _reference(channel, tenant: str) -> str:
    request = build_request("the quick brown fox", max_new_tokens=8)
    return "".join(r.chunk.text for r in channel.unary_stream(
        "/specdec.v1.Orchestrator/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString)(
            request, timeout=60, metadata=(("authorization", f"Bearer {TOKENS[tenant]}"),))
        if r.HasField("chunk"))


BEFORE: dict[str, str] = {}


def test_reference_before(tenants_stack) -> None:
    BEFORE.update({t: _reference(tenants_stack, t) for t in TOKENS})
    assert all(BEFORE.values())


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(burst=st.lists(st.tuples(generate_request(), credentials), min_size=3, max_size=3))
def test_generate_bursts_under_random_credentials(tenants_stack, burst) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(burst)) as pool:
        list(pool.map(lambda item: _call(tenants_stack, *item), burst))


def test_every_limit_was_reached_and_each_tenant_still_gets_its_text(tenants_stack) -> None:
    # Explicit bursts past each limit, besides the random ones: 3 long streams at once (2 allowed),
    # kept sessions past 2, then calls past the rate's burst.
    long = build_request("one two three four", max_new_tokens=24, ignore_eos=True)
    alice = f"Bearer {TOKENS['alice']}"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: _call(tenants_stack, long, alice), range(3)))
    for _ in range(3):
        _call(tenants_stack, build_request("kept", max_new_tokens=2, keep_session=True), f"Bearer {TOKENS['bob']}")
    _until_rate_limited(tenants_stack, alice)
    assert SEEN["UNAUTHENTICATED"] and SEEN["PERMISSION_DENIED"], SEEN
    assert all(HIT[limit] for limit in LIMITS), (HIT, SEEN)
    assert {t: _refilled_reference(tenants_stack, t) for t in TOKENS} == BEFORE


def _until_rate_limited(channel, authorization: str, batch: int = 24, batches: int = 10) -> None:
    """Concurrent one-token calls until the tenant's bucket says no. The bucket is taken before
    any other check, so a batch of 24 outruns a burst of 10 however slowly each call decodes;
    sequential calls would not where a call takes longer than the refill (1/20 s)."""
    cheap = build_request("x", max_new_tokens=1)
    for _ in range(batches):
        with concurrent.futures.ThreadPoolExecutor(batch) as pool:
            list(pool.map(lambda _: _call(channel, cheap, authorization), range(batch)))
        if HIT["rate_per_tenant"]:
            return


def _refilled_reference(channel, tenant: str) -> str:
    """The reference text once the tenant's rate bucket has refilled (polled, at most 10 s)."""
    import time

    deadline = time.monotonic() + 10
    while True:
        try:
            return _reference(channel, tenant)
        except grpc.RpcError as exc:
            if not (exc.details() or "").startswith("rate_per_tenant:") or time.monotonic() > deadline:
                raise
            time.sleep(0.2)

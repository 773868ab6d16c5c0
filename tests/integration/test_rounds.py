"""Stats.rounds: one entry per round, consistent with the per-request totals.

Against the session stack (tiny target + draft + orchestrator, real Redis).
"""
from __future__ import annotations

import asyncio

import pytest

PROMPT = "Please rewrite the following sentence: the cat sat on the mat and purred."
N_NEW = 24

# Stats totals that are sums over rounds, by name in both messages.
SUMMED_MS = ("draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms", "redis_ms")
SUMMED_COUNTS = ("bytes_sent", "bytes_received", "cache_misses")
PARTS = ("draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms", "redis_ms")


def check_rounds(s, k: int, n_new: int) -> None:
    rounds = list(s.rounds)
    assert len(rounds) == s.target_passes >= 1
    assert [r.drafted for r in rounds] == list(s.drafted_per_round)
    assert [r.accepted for r in rounds] == list(s.accepted_per_round)
    assert sum(r.drafted for r in rounds) == s.drafted_tokens
    assert sum(r.accepted for r in rounds) == s.accepted_tokens
    assert sum(r.committed for r in rounds) == s.new_tokens == n_new
    for name in SUMMED_COUNTS:
        assert sum(getattr(r, name) for r in rounds) == getattr(s, name), name
    for name in SUMMED_MS:
        assert sum(getattr(r, name) for r in rounds) == pytest.approx(getattr(s, name), abs=1e-6), name
    # Rounds are contiguous from the request's start: they add up to its wall time.
    assert sum(r.total_ms for r in rounds) == pytest.approx(s.total_ms, rel=0.01, abs=0.5)
    left = n_new
    for i, r in enumerate(rounds):
        assert sum(getattr(r, p) for p in PARTS) == pytest.approx(r.total_ms, abs=1e-6), i
        assert r.k == min(k, left - 1), i  # the orchestrator's rule for a fixed k
        assert r.drafted <= r.k and r.accepted <= r.drafted
        assert r.committed == r.accepted + 1  # no EOS / stop here: every verdict commits whole
        assert r.target_ms > 0 and r.serialize_ms > 0 and r.network_ms >= 0
        assert r.bytes_sent > 0 and r.bytes_received > 0
        assert r.redis_write_ms >= 0
        assert r.draft_ms > 0 if r.drafted else r.draft_ms == 0  # draft = the draft service's own time
        left -= r.committed
    assert rounds[0].redis_ms > 0  # the session load and routing belong to round 1
    # The writer coalesces pending states, so not every round writes; round 1's
    # write starts at once (nothing pending) and lands while round 2 runs.
    assert len(rounds) == 1 or rounds[0].redis_write_ms > 0
    over = sorted(r.total_ms - r.draft_ms - r.target_ms for r in rounds)
    assert s.overhead_p50_ms == pytest.approx(
        over[len(over) // 2] if len(over) % 2 else (over[len(over) // 2 - 1] + over[len(over) // 2]) / 2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rounds_match_totals_draft(client, temperature):
    out = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="draft", k=3,
                          temperature=temperature, seed=7)
    assert out.stats.proposer == "draft" and not out.stats.fallback_reason
    check_rounds(out.stats, 3, N_NEW)
    assert out.stats.serialize_ms > 0


def test_rounds_target_only(client):
    s = client.complete(PROMPT, max_new_tokens=10, proposer="none").stats
    check_rounds(s, 0, 10)
    assert all(r.k == 0 and r.drafted == 0 and r.draft_ms == 0 for r in s.rounds)


def test_sampling_rounds_carry_probabilities(client):
    """Rejection sampling (a request without a seed) ships distributions back; greedy and the coupled
    sampler (a seeded request) only ids: bytes per round show it."""
    greedy = client.complete(PROMPT, max_new_tokens=8, proposer="draft", k=3).stats
    rejection = client.complete(PROMPT, max_new_tokens=8, proposer="draft", k=3, temperature=0.8).stats
    coupled = client.complete(PROMPT, max_new_tokens=8, proposer="draft", k=3, temperature=0.8, seed=3).stats
    g = max(r.bytes_received for r in greedy.rounds)
    assert min(r.bytes_received for r in rejection.rounds) > 4 * g
    assert max(r.bytes_received for r in coupled.rounds) < 2 * g


def test_model_client_times_serialization(stack):
    """A Call's bytes are the messages' sizes; its parts fit inside the RPC time."""
    from orchestrator.fleet.remote import ModelClient
    from specdec.core.fingerprint import EMPTY
    from specdec.core.sampling import SamplingParams
    from specdec.v1 import common_pb2, model_pb2
    from specdec.runtime.wire import sampling_to_proto

    async def run():
        client = ModelClient(stack.addresses["target"], "target")
        try:
            request = model_pb2.ScoreRequest(
                session_id="rounds-test-serialize", cache_position=0, prefix_hash=EMPTY,
                tokens=list(range(5, 45)), k=4,
                sampling=sampling_to_proto(SamplingParams(temperature=1.0)),
                output_mode=common_pb2.OUTPUT_MODE_PROBS,
            )
            response, call = await client.score(request)
            await client.release("rounds-test-serialize")
            return request, response, call
        finally:
            await client.close()

    request, response, call = asyncio.run(run())
    assert call.bytes_sent == request.ByteSize()
    assert call.bytes_received == response.ByteSize() > 0
    assert call.server_ms == response.timing.total_ms > 0
    assert call.serialize_ms > 0
    assert call.server_ms + call.serialize_ms + call.network_ms == pytest.approx(call.rpc_ms)


def test_a_first_round_feeds_the_draft_beside_the_score(stack, tiny_pair):
    """No k in the request: the first round feeds the draft its prompt while the target scores it
    (drafting nothing), so the second round's Propose sends the draft only what it lacks then;
    with a fixed k the first round drafts as before. Greedy text the same either way. On an
    orchestrator of its own: a fresh speculation gate starts by allowing drafting (the shared
    one may have measured plain decoding faster on the tiny models and allow none)."""
    import urllib.request

    from client import Client

    address = stack.start_orchestrator("orch-prefetch", tiny_pair[0])

    def prefilled() -> float:  # committed tokens the draft was fed, in all
        text = urllib.request.urlopen(f"http://127.0.0.1:{stack.draft_metrics_port}/metrics", timeout=5).read()
        return sum(float(line.split()[-1]) for line in text.decode().splitlines()
                   if line.startswith("specdec_tokens_prefilled_total"))

    try:
        _first_round_checks(Client(address, timeout=120), prefilled)
    finally:
        stack.stop_one("orch-prefetch")


def _first_round_checks(c, prefilled) -> None:
    with c as client:
        ref = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="none")
        before = prefilled()
        out = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="draft", round_tokens=True)
        fed = prefilled() - before
        rounds = list(out.stats.rounds)
        assert list(out.token_ids) == list(ref.token_ids)
        assert rounds[0].k > 0  # a fresh gate: drafting allowed ...
        assert rounds[0].drafted == 0 and rounds[0].draft_ms == 0.0  # ... yet the draft was fed instead
        assert fed >= out.stats.prompt_tokens  # the prompt reached the draft in that first round
        # Every committed token reaches the draft once (the prompt with the first Score); none twice.
        assert fed <= out.stats.prompt_tokens + N_NEW
        fixed = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="draft", k=3)
        assert fixed.stats.rounds[0].drafted > 0 and list(fixed.token_ids) == list(ref.token_ids)

"""Goodput-adaptive k through the real loop (orchestrator.loop.generate) and the cost table.

The fake services of test_loop report ServerTiming like a batching service: a
forward's cost as a function of its tokens and the batch it ran in. Loaded
with 16 rows on a compute-bound target, an adaptive session mostly sends k = 0
(with probes); alone it drafts. Greedy output is the same either way.
"""
from __future__ import annotations

from dataclasses import replace

from orchestrator.policy.costs import CostBook
from orchestrator.fleet.remote import Call
from tests.unit.test_loop import PROMPTS, Stack, make_models, plain_greedy


def with_timing(stack: Stack, rows: int, verify_ms, step_ms: float = 2.0) -> Stack:
    """Make every fake reply carry forward_ms and the batch (rows x the call's tokens)."""
    for svc in stack.services.values():
        if svc.role == "target":
            score = svc.score

            async def timed_score(request, score=score):
                response, call = await score(request)
                tokens = rows * len(request.tokens)
                ms = verify_ms(tokens)
                return response, replace(call, rpc_ms=ms + 1.0, server_ms=ms, forward_ms=ms, batch_rows=rows,
                                         batch_tokens=tokens, tokens=len(request.tokens))

            svc.score = timed_score
        else:
            propose = svc.propose

            async def timed_propose(request, propose=propose):
                response, call = await propose(request)
                ms = step_ms * max(1, request.k)
                return response, replace(call, rpc_ms=ms + 1.0, server_ms=ms, forward_ms=ms, batch_rows=1,
                                         batch_tokens=len(request.tokens), tokens=len(request.tokens))

            svc.propose = timed_propose
    return stack


def compute_bound(tokens: float) -> float:
    return 15.0 * max(tokens, 4.0)


def test_adaptive_k_goes_to_zero_under_load_probes_and_drafts_alone() -> None:
    target, draft = make_models(1)
    prompt = PROMPTS[1]
    ref = plain_greedy(target, prompt)
    alone = with_timing(Stack(target, draft, adaptive_k=True), rows=1, verify_ms=compute_bound)
    out, _, tally = alone.run(prompt, k=0)
    assert out == ref
    ks = [r.k for r in tally.rounds]
    assert sum(k > 0 for k in ks) > len(ks) / 2, ks

    loaded = with_timing(Stack(target, draft, adaptive_k=True), rows=16, verify_ms=compute_bound)
    out, _, tally = loaded.run(prompt, k=0, max_new=64)
    assert out == plain_greedy(target, prompt, 64)
    ks = [r.k for r in tally.rounds]
    assert ks[0] == 2  # nothing measured yet: the start k
    assert ks.count(0) > len(ks) / 2, ks  # k = 0 where drafting does not pay ...
    assert any(k > 0 for k in ks[8:]), ks  # ... with probes, so it could return
    table = loaded.config.costs.replica("target", "t0")
    assert table.measured and round(table.rows.value) == 16


def test_cost_book_learns_verify_cost_and_load() -> None:
    book = CostBook()
    assert book.round_costs("t", "d") is None  # nothing measured
    for tokens, rows in ((1, 1), (16, 16), (64, 16), (16, 16)):
        ms = 10.0 + 2.0 * tokens
        book.observe("target", "t", Call(rpc_ms=ms + 3, server_ms=ms, bytes_sent=0, bytes_received=0,
                                         forward_ms=ms, batch_rows=rows, batch_tokens=tokens, tokens=1))
    costs = book.round_costs("t", "d")
    assert costs is not None and abs(costs.verify_ms(40) - 90.0) < 1e-6 and costs.round_ms > 0
    assert 8 < costs.rows <= 16
    # A service without batching (rows 0): the call's own tokens are the forward's.
    book.observe("target", "u", Call(rpc_ms=20, server_ms=12, bytes_sent=0, bytes_received=0, forward_ms=12,
                                     tokens=5))
    assert book.round_costs("u", None).rows == 1 and book.replica("target", "u").verify_ms(5) == 12
    # A chunked call (summed) and a call without forward time teach nothing.
    chunked = Call(1, 1, 0, 0, forward_ms=5, tokens=100, calls=2)
    book.observe("target", "v", chunked)
    assert not book.replica("target", "v").measured
    book.observe("draft", "d", Call(rpc_ms=14, server_ms=12, bytes_sent=0, bytes_received=0, forward_ms=10), 4)
    assert book.round_costs("t", "d").draft_step_ms == 3.0  # queueing included: 12 ms server time / 4
    assert book.round_costs("t", "d").draft_call_ms == 2.0


def test_forwards_split_the_forward_time() -> None:
    book = CostBook()
    # A Score fed in two prefill chunks (two forwards summed) is no sample of one forward's cost.
    book.observe("target", "t", Call(1, 1, 0, 0, forward_ms=40, batch_rows=1, batch_tokens=64, tokens=100,
                                     forwards=2))
    assert not book.replica("target", "t").measured
    book.observe("target", "t", Call(1, 1, 0, 0, forward_ms=20, batch_rows=1, batch_tokens=5, tokens=5, forwards=1))
    # A Propose drafting 4 tokens whose server time (queueing, 6 forwards) was 6 ms: 1.5 ms a token.
    book.observe("draft", "d", Call(7, 6, 0, 0, forward_ms=5.0, forwards=6), drafted=4)
    assert book.round_costs("t", "d").draft_step_ms == 1.5


def test_load_counts_sessions_away_drafting_on_a_batching_replica() -> None:
    book = CostBook()
    costs = book.replica("target", "t")
    for rows in (16, 4, 4, 4):  # 16 sessions once shared a forward; now 4 at a time (the rest drafting)
        book.observe("target", "t", Call(1, 1, 0, 0, forward_ms=10, batch_rows=rows, batch_tokens=rows, tokens=1))
    assert costs.rows.value < 6
    for i in range(16):  # ... but 16 sessions are calling it
        costs.observe_session(f"s{i}", now=100.0 + i * 0.01)
    assert costs.load_rows(now=100.2) > 15
    assert costs.load_rows(now=200.0) < 6  # they left
    # A replica that never batches (rows 1) stays at 1 whatever the sessions.
    one = book.replica("target", "u")
    book.observe("target", "u", Call(1, 1, 0, 0, forward_ms=10, batch_rows=1, batch_tokens=1, tokens=1))
    for i in range(16):
        one.observe_session(f"s{i}", now=100.0)
    assert one.load_rows(now=100.1) == 1.0


def test_a_draft_cost_measured_under_past_load_ages_away() -> None:
    from orchestrator.policy.costs import STALE_HALFLIFE_S, ReplicaCosts

    costs = ReplicaCosts()
    busy = Call(rpc_ms=42, server_ms=40, bytes_sent=0, bytes_received=0, tokens=1)
    for t in range(8):  # a loaded draft: 10 ms a drafted token (queueing included)
        costs.observe_propose(busy, drafted=4, now=100.0 + 0.1 * t)
    assert costs.step_ms.value == 10.0
    light = Call(rpc_ms=10, server_ms=8, bytes_sent=0, bytes_received=0, tokens=1)
    costs.observe_propose(light, drafted=4, now=100.8)  # soon after: the usual EWMA weight
    assert abs(costs.step_ms.value - (10.0 + 0.25 * (2.0 - 10.0))) < 1e-9
    before = costs.step_ms.value
    costs.observe_propose(light, drafted=4, now=100.8 + 4 * STALE_HALFLIFE_S)  # long after
    assert abs(costs.step_ms.value - (before + (1 - 0.5 ** 4) * (2.0 - before))) < 1e-9


def test_a_catch_up_feed_is_not_drafting_cost() -> None:
    from orchestrator.policy.costs import ReplicaCosts

    costs = ReplicaCosts()
    # A probe after many k = 0 rounds: 40 committed tokens fed, then 2 drafted, in 9 ms: the feed
    # counts as one step (3 ms each), not as 4.5 ms per drafted token.
    costs.observe_propose(Call(rpc_ms=10, server_ms=9, bytes_sent=0, bytes_received=0, tokens=40), drafted=2,
                          now=1.0)
    assert costs.step_ms.value == 3.0
    fresh = ReplicaCosts()
    fresh.observe_propose(Call(rpc_ms=10, server_ms=9, bytes_sent=0, bytes_received=0, tokens=2), drafted=3,
                          now=1.0)
    assert fresh.step_ms.value == 3.0  # the usual one or two committed tokens: drafting alone

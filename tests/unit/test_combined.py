"""The combined proposer's per-round choice: lookup, draft or neither, by goodput.

Costs are taught to a real CostBook through the same observe() calls the loop
makes (Calls with the services' forward timings); acceptance through the
proposer's own commit(). The loop-level checks (greedy identity, sampled
exactness with lookup and draft rounds mixed) are in test_loop.py.
"""
from __future__ import annotations

from types import SimpleNamespace

from orchestrator.proposers.combined import LOOKUP_POOL, CombinedProposer
from orchestrator.policy.costs import CostBook
from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.proposers.local import PromptLookupProposer
from orchestrator.fleet.remote import Call
from orchestrator.common.kinds import DRAFT, LOOKUP
from orchestrator.proposers.base import Committed, Proposal
from specdec.core.verify import BONUS, RECOVERED, Verdict

GUESS = [5, 6, 7, 8]


def book(*, verify_ms, step_ms: float = 2.0) -> CostBook:
    """A CostBook that has seen target forwards costing verify_ms[T] at T tokens and draft steps of step_ms."""
    b = CostBook()
    for _ in range(4):
        for tokens, ms in verify_ms.items():
            b.observe("target", "t", Call(rpc_ms=ms + 1, server_ms=ms, bytes_sent=0, bytes_received=0,
                                          forward_ms=ms, tokens=tokens, forwards=1))
        b.observe("draft", "d", Call(rpc_ms=4 * step_ms + 1, server_ms=4 * step_ms, bytes_sent=0,
                                     bytes_received=0), drafted=4)
    return b


LATENCY_BOUND = {1: 40.0, 2: 42.0, 5: 46.0, 9: 52.0}  # a GPU-like target: extra tokens nearly free
COMPUTE_BOUND = {1: 40.0, 2: 60.0, 5: 120.0, 9: 200.0}  # every extra token costs half a pass


def proposer(b: CostBook, *, draft: bool = True) -> CombinedProposer:
    replica = SimpleNamespace(address="d", held=0) if draft else None
    return CombinedProposer(DraftServiceProposer(replica), PromptLookupProposer(), b, lambda: "t")


def teach(p: CombinedProposer, source: str, drafted: int, accepted: int, rounds: int = 30) -> None:
    """`rounds` rounds from `source`, each accepting `accepted` of `drafted`, as the loop commits them."""
    verdict = Verdict(accepted, [5] * (accepted + 1), BONUS if accepted == drafted else RECOVERED)
    for _ in range(rounds):
        p._last = source
        p.commit(Committed(Proposal([5] * drafted), drafted, drafted, verdict, tokens=[1, 2, *verdict.tokens],
                           committed=len(verdict.tokens)))


def test_a_lookup_that_is_usually_right_wins_over_a_weak_draft() -> None:
    p = proposer(book(verify_ms=LATENCY_BOUND))
    teach(p, LOOKUP, 4, 4)
    teach(p, DRAFT, 4, 0)
    source, n = p.choose(4, GUESS)
    assert source == LOOKUP and n == 4


def test_a_good_draft_wins_over_a_lookup_that_is_usually_wrong() -> None:
    p = proposer(book(verify_ms=LATENCY_BOUND))
    teach(p, LOOKUP, 4, 0)
    teach(p, DRAFT, 4, 4)
    source, k = p.choose(4, GUESS)
    assert source == DRAFT and k >= 3


def test_neither_on_a_compute_bound_target_with_wrong_guesses() -> None:
    p = proposer(book(verify_ms=COMPUTE_BOUND))
    teach(p, LOOKUP, 4, 0)
    teach(p, DRAFT, 4, 0)
    assert p.choose(4, GUESS) == (DRAFT, 0)  # a target-only round
    # ... but a lookup that is always right pays even there: 5 tokens for one 120 ms pass.
    q = proposer(book(verify_ms=COMPUTE_BOUND))
    teach(q, LOOKUP, 4, 4)
    assert q.choose(4, GUESS) == (LOOKUP, 4)


def test_lookup_length_is_cut_where_its_acceptance_runs_out() -> None:
    p = proposer(book(verify_ms=COMPUTE_BOUND))
    teach(p, LOOKUP, 4, 1, rounds=200)  # position 1 always right, position 2 never
    assert p.choose(4, GUESS) == (LOOKUP, 1)


def test_without_measurements_the_free_guess_goes_first_and_no_guess_means_the_draft() -> None:
    p = proposer(CostBook())
    assert p.choose(4, GUESS) == (LOOKUP, 4)
    source, k = p.choose(4, [])
    assert source == DRAFT and k > 0  # GoodputPolicy's start_k
    alone = proposer(CostBook(), draft=False)
    assert alone.choose(4, []) == (DRAFT, 0)  # no draft replica: nothing to draft with


def test_lookup_rounds_feed_a_pool_that_a_new_session_starts_from() -> None:
    b = book(verify_ms=LATENCY_BOUND)
    first = proposer(b)
    teach(first, LOOKUP, 4, 4)
    assert b.acceptance(LOOKUP_POOL).rate(0) == 1.0
    second = proposer(b)  # no rounds of its own yet: the pooled rates are its prior
    teach(second, DRAFT, 4, 0)
    assert second.choose(4, GUESS) == (LOOKUP, 4)


def test_a_lookup_written_off_is_tried_again_and_returns_when_it_pays() -> None:
    """One failed guess pooled a rate of 0 for every position, and nothing ever tried lookup again
    on that orchestrator (the demo's repeating text went unproposed). Now a guess not taken for
    a while is proposed as a probe (the draft's own k = 0 probes, for lookup), and lookup wins
    again once its probes are accepted."""
    b = book(verify_ms=COMPUTE_BOUND)
    first = proposer(b)
    teach(first, LOOKUP, 4, 0, rounds=1)  # one unlucky guess
    p = proposer(b)  # a later session: the pool's 0 is its prior
    teach(p, DRAFT, 4, 0)
    picks = [p.choose(4, GUESS) for _ in range(8)]
    assert picks[:7] == [(DRAFT, 0)] * 7  # nothing pays ...
    source, n = picks[7]
    assert source == LOOKUP and 0 < n <= 2  # ... but the eighth round probes the guess
    teach(p, LOOKUP, n, n, rounds=12)  # the probes are right
    assert p.choose(4, GUESS)[0] == LOOKUP


def test_a_plain_round_asks_no_source_and_weighs_nothing() -> None:
    """k = 0 (the speculation gate's plain epoch under load): an empty proposal at the draft's held
    length, without a guess, a draft call or the goodput comparison (a round's cost at N = 64)."""
    import asyncio

    from orchestrator.proposers.base import DraftContext

    p = proposer(book(verify_ms=LATENCY_BOUND))
    p.draft.replica.held = 7
    asked: list[str] = []

    class Counting(PromptLookupProposer):
        async def propose(self, ctx):
            asked.append("lookup")
            return await super().propose(ctx)

    p.free = {LOOKUP: Counting()}
    p.sources.book = None  # any goodput comparison would fail on it
    ctx = DraftContext("s", [1, 2, 3, 1, 2], [0] * 6, 3, 0, None, 0)
    out = asyncio.run(p.propose(ctx))
    assert out.tokens == [] and out.cache_length == 7 and out.source == "" and asked == []

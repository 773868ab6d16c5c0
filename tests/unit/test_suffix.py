"""Suffix decoding: the index (specdec.core.suffix), its bounded per-tenant cache, and the proposer
through the real loop (orchestrator.proposers.suffix) on the loop tests' table models.

Statistical check (tests.chance): one, the sampled chain's first two tokens through suffix
proposals, chi-square at p > FALSE_ALARM = 1e-6 for fresh seeds (its seeds are fixed). Its
control is tests/unit/test_loop.py's misreported-q draft, which fails the same statistic.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from orchestrator.common.kinds import SUFFIX
from orchestrator.proposers.base import DraftContext
from orchestrator.proposers.suffix import SuffixHome, SuffixProposer
from specdec.core.suffix import MAX_MATCH, SuffixCache, SuffixIndex, propose, propose_tree
from tests.unit.test_loop import (
    P_THRESHOLD, PROMPTS, S_TRIALS, Stack, chain_pvalues, first_two_tokens, make_models, plain_greedy,
)


def brute_match(sequences: list[list[int]], context: list[int]) -> int:
    """The longest suffix of `context` that occurs, followed by a token, in one of `sequences`."""
    best = 0
    for seq in sequences:
        for end in range(1, len(seq)):
            n = 0
            while n < min(end, len(context), MAX_MATCH) and seq[end - 1 - n] == context[-1 - n]:
                n += 1
            best = max(best, n)
    return best


def test_the_longest_match_is_found_and_continued_by_the_most_frequent_path() -> None:
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 6, 7])
    index.add([9, 2, 3, 4, 5, 8, 8])
    index.add([0, 4, 5, 8, 9])
    found = index.match([0, 3, 4, 5])
    assert found.length == 3 and len(found.ends) == 2  # "3 4 5" twice; "4 5" three times is shorter
    assert propose(index, [0, 3, 4, 5], 8) == ([8, 8], 3)  # the most recent of two equal counts
    # Only a match as long as the proposal: a 1-token match proposes 1 token.
    assert propose(index, [6], 8) == ([7], 1)
    assert propose(index, [42], 8) == ([], 0)
    tokens, parents, _ = propose_tree(index, [2, 3, 4, 5], 8, nodes=8, width=2)
    assert (tokens, parents) == ([8, 8, 6, 7], [-1, 0, -1, 2])  # both continuations: 8 and 6 siblings


def test_a_continuation_below_the_least_probability_is_not_proposed() -> None:
    index = SuffixIndex()
    for tail in ([7, 7], [7, 8], [7, 9], [7, 10], [7, 11]):
        index.add([1, 2, 3, *tail])
    tokens, _ = propose(index, [1, 2, 3], 4, min_prob=0.3)
    assert tokens == [7]  # 7 in 5 of 5; each second token in 1 of 5 < 0.3
    assert propose(index, [1, 2, 3], 4, min_prob=0.1)[0][:2] == [7, 11]


def test_matches_agree_with_a_brute_force_search() -> None:
    rng = random.Random(5)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(5, 60))] for _ in range(20)]
    index = SuffixIndex()
    for seq in sequences:
        index.add(seq)
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        found = index.match(context)
        assert (found.length if found else 0) == brute_match(sequences, context), context


def test_the_open_sequence_matches_only_earlier_occurrences() -> None:
    own = SuffixIndex()
    own.extend([1, 2, 3, 1, 2])
    assert propose(own, [1, 2, 3, 1, 2], 4) == ([3, 1], 2)
    own.extend([3, 9])
    assert propose(own, [1, 2, 3, 1, 2, 3, 9], 4) == ([], 0)  # 9 has not occurred before


def test_the_cache_is_bounded_evicts_the_oldest_and_compacts() -> None:
    cache = SuffixCache(max_tokens=100)
    rng = random.Random(1)
    kept: list[list[int]] = []
    for i in range(200):
        seq = [rng.randrange(50) for _ in range(rng.randrange(3, 20))]
        cache.add("a", seq)
        kept.append(seq)
        assert cache.tokens <= 100
    # What is left answers as an index built afresh from the newest sequences that fit.
    fresh, total, newest = SuffixIndex(), 0, []
    for seq in reversed(kept):
        if total + len(seq) + 1 > cache.tokens:
            break
        total += len(seq) + 1
        newest.insert(0, seq)
    for seq in newest:
        fresh.add(seq)
    index = cache.index("a")
    assert len(index) == cache.tokens == total
    for _ in range(200):
        context = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        assert propose(index, context, 6) == propose(fresh, context, 6)
    assert len(index._tokens) < 2 * 100 + 25  # compacted: the dead prefix does not pile up
    assert SuffixCache(max_tokens=10).add("a", list(range(20))) is None  # larger than the cache: skipped


def test_one_tenants_turns_never_propose_to_another() -> None:
    home = SuffixHome.__new__(SuffixHome)
    home.cache = SuffixCache(max_tokens=1000)
    alice = SuffixProposer(home.cache, "alice")
    ctx = DraftContext("s", [5, 6, 7, 8, 9, 10, 11, 12], [0] * 9, 2, 8, None, 0, tenant="alice")
    asyncio.run(alice.propose(ctx))
    alice.close()  # the turn ends: its tokens join alice's cache
    again = DraftContext("s2", [5, 6, 7], [0] * 4, 2, 8, None, 0)
    assert asyncio.run(SuffixProposer(home.cache, "alice").propose(again)).tokens == [8, 9, 10]
    assert asyncio.run(SuffixProposer(home.cache, "bob").propose(again)).tokens == []
    assert home.cache.index("bob") is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suffix_greedy_equals_plain_greedy_and_learns_across_requests(seed: int) -> None:
    target, draft = make_models(seed)
    stack = Stack(target, draft)
    for prompt in PROMPTS:
        reference = plain_greedy(target, prompt)
        out, _, first = stack.run(prompt, k=0, proposer=SUFFIX)
        out2, _, second = stack.run(prompt, k=0, proposer=SUFFIX)
        assert out == out2 == reference
        assert first.proposer == SUFFIX and first.cache_misses == 0
        # The second time the whole continuation is in the cache: the first round proposes as
        # many tokens as the prompt it matched, past the default k (5), and all are accepted.
        assert second.accepted_per_round[0] == min(len(prompt), 16, len(reference) - 1) > 5
        assert second.target_passes <= first.target_passes


def test_sampled_output_through_suffix_proposals_has_the_target_distribution() -> None:
    """Deterministic proposals (one-hot q) learned from earlier draws: still the target's chain."""
    tokens, accepted = first_two_tokens(misreport_q=False, trials=S_TRIALS // 2, proposer=SUFFIX)
    assert accepted[1:].sum() > S_TRIALS // 20  # earlier draws do get proposed and accepted
    p_first, p_joint = chain_pvalues(tokens)
    print(f"\nsuffix exactness: first-token p={p_first:.4f}, two-token joint p={p_joint:.4f}")
    assert p_first > P_THRESHOLD and p_joint > P_THRESHOLD


def test_a_free_guess_tree_crops_the_draft_at_what_it_held_before_the_round() -> None:
    """A tree from a free source (lookup, suffix) carries no `held` flags: the draft fed none of
    it. The crop once indexed an empty list there (IndexError, an INTERNAL error mid-stream)."""
    from types import SimpleNamespace

    from orchestrator.proposers.base import Committed, Proposal
    from specdec.core.verify import verify_tree

    tokens, parents = [7, 8, 9, 5], [-1, 0, 1, -1]
    verdict = verify_tree(tokens, parents, [7, 8, 9, 6, 0])  # the path 7 8 9 accepted, then 6
    done = Committed(Proposal(tokens, cache_length=3, parents=parents), drafted=4, own=4, verdict=verdict,
                     tokens=[1, 2, 3, 4, *verdict.tokens], committed=len(verdict.tokens))
    assert verdict.accepted == 3 and done.before == 4 and done.draft_keeps() == 3


def test_a_negative_cache_size_refuses_to_start() -> None:
    from orchestrator.__main__ import StartupError, gray_from_args, parse_args
    from orchestrator.policy.costs import CostBook

    with pytest.raises(StartupError, match="--suffix-cache-tokens: must be >= 0, got -1"):
        gray_from_args(parse_args(["--suffix-cache-tokens", "-1"]), CostBook())
    gray_from_args(parse_args(["--suffix-cache-tokens", "0"]), CostBook())  # 0: remember nothing


def _state(cache: SuffixCache) -> dict:
    return {tenant: (index._tokens, index._prev, index._last, index._open, index.base)
            for tenant, index in cache._tenants.items()}


def test_learning_a_step_at_a_time_ends_where_adding_at_once_does(monkeypatch) -> None:
    """Two tenants' turns through a full cache (evictions and compactions): stepping each add in
    chunks of 16 tokens leaves the very index adding at once does, and no step indexes more than
    16 tokens, compactions included."""
    rng = random.Random(3)
    turns = [("ab"[rng.randrange(2)], [rng.randrange(40) for _ in range(rng.randrange(1, 90))]) for _ in range(120)]
    at_once, stepped = SuffixCache(max_tokens=600), SuffixCache(max_tokens=600)
    indexed = [0]
    original = SuffixIndex._index
    monkeypatch.setattr(SuffixIndex, "_index", lambda self, end: (indexed.__setitem__(0, indexed[0] + 1),
                                                                   original(self, end))[1])
    most, steps = 0, 0
    for tenant, tokens in turns:
        at_once.add(tenant, tokens)
        indexed[0] = 0
        for _ in stepped.adding(tenant, tokens, chunk=16):
            most, steps = max(most, indexed[0]), steps + 1
            indexed[0] = 0
        assert _state(stepped) == _state(at_once)
    assert 0 < most <= 16 and steps > 120 * 2
    assert any(len(i._tokens) < 600 for i in stepped._tenants.values())  # compactions ran


def test_a_compaction_swaps_its_index_in_at_its_last_step_only() -> None:
    index = SuffixIndex()
    for seq in ([1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 2, 3, 7]):
        index.add(seq)
    index.evict(5, compact=False)  # the first sequence and its separator
    before = _state_of(index)
    steps = index.compacting(chunk=2)
    next(steps)
    assert _state_of(index) == before  # mid-way: the old index, still consistent
    for _ in steps:
        pass
    assert index.base == 0 and index._tokens == [5, 6, 7, 8, 9, -1, 1, 2, 3, 7, -1]
    assert propose(index, [1, 2, 3], 2) == propose(_fresh([[5, 6, 7, 8, 9], [1, 2, 3, 7]]), [1, 2, 3], 2)


def _state_of(index: SuffixIndex) -> tuple:
    return (list(index._tokens), {n: list(v) for n, v in index._prev.items()},
            {n: dict(v) for n, v in index._last.items()}, index._open, index.base)


def _fresh(seqs: list[list[int]]) -> SuffixIndex:
    index = SuffixIndex()
    for seq in seqs:
        index.add(seq)
    return index


def test_the_home_learns_between_other_work_on_the_event_loop() -> None:
    """A finished turn joins the cache a step per turn of the event loop: another task runs
    between the steps, and once the steps are done the next request of the tenant matches it."""
    from types import SimpleNamespace

    home = SuffixHome(SimpleNamespace(suffix_cache_tokens=10_000))
    turn = [random.Random(5).randrange(1000) for _ in range(2000)]

    async def main() -> tuple[int, int, list[int]]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        proposer = home.proposer("t")
        proposer.tokens = turn
        proposer.close()  # the turn ends
        started = ticks
        while home.learning:
            await asyncio.sleep(0)
        task.cancel()
        again = DraftContext("s2", turn[:100], [0] * 101, 2, 8, None, 0, tenant="t")
        return home.steps, ticks - started, (await home.proposer("t").propose(again)).tokens

    steps, ticks, proposed = asyncio.run(main())
    assert steps >= 2000 // 256 and ticks >= steps - 1  # the ticker ran between the steps
    assert proposed == turn[100:108]


def test_a_dropped_index_is_freed_a_piece_a_step() -> None:
    from specdec.core.suffix import free

    boxes = [list(range(20_000)), {i: i for i in range(10_000)}]
    sizes, steps = [], free(boxes, per_step=8192)
    for _ in steps:
        sizes.append(sum(len(b) for b in boxes))
    assert sizes[-1] == 0 and len(sizes) >= 4
    assert all(0 < before - after <= 8192 for before, after in zip([30_000, *sizes], sizes))

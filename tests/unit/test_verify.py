"""verify_greedy / verify_sampled / verify_sampled_batch on peaked logits (deterministic outcomes)."""
from __future__ import annotations

import pytest
import torch

from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.core.stopping import clip_to_stop
from specdec.core.verify import BONUS, RECOVERED, Verdict, verify_greedy, verify_sampled, verify_sampled_batch

torch.set_num_threads(1)

V = 50


def peaked(tokens: list[int], vocab: int = V, height: float = 60.0) -> torch.Tensor:  # [len, vocab]
    """Distributions with (numerically) all their mass on the given tokens."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = height
    return torch.softmax(logits, -1)


# (drafted, target's tokens per position, expected accepted, expected tokens, kind)
CASES = [
    ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8], BONUS),  # perfect match, bonus token
    ([5, 6, 7], [9, 6, 7, 8], 0, [9], RECOVERED),  # early mismatch
    ([5, 6, 7], [5, 6, 1, 8], 2, [5, 6, 1], RECOVERED),  # reject at the last position
    ([], [4], 0, [4], BONUS),  # empty draft: ordinary decoding
    ([5, 2, 7, 7], [5, 2, 7, 7, 3], 4, [5, 2, 7, 7, 3], BONUS),
]


@pytest.mark.parametrize("drafted,target,m,tokens,kind", CASES)
def test_greedy_cases(drafted, target, m, tokens, kind) -> None:
    assert verify_greedy(drafted, target) == Verdict(m, tokens, kind)


@pytest.mark.parametrize("drafted,target,m,tokens,kind", CASES)
@pytest.mark.parametrize("proposer", ["one_hot", "draft_model"])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_sampled_cases_with_peaked_logits(drafted, target, m, tokens, kind, proposer, seed) -> None:
    q = peaked(drafted) if proposer == "draft_model" and drafted else None
    verdict = verify_sampled(drafted, q, peaked(target), seed=seed, position=17)
    assert verdict == Verdict(m, tokens, kind)
    assert verdict.accepted_tokens == drafted[:m]
    assert verdict.extra_token == tokens[-1]
    assert verdict.all_accepted == (kind == BONUS)


def test_greedy_one_hot_probs_reduce_to_greedy_verification() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        k = trial % 6
        logits = torch.randn(k + 1, V, generator=gen)
        argmax = logits.argmax(-1).tolist()
        drafted = [a if torch.rand(1, generator=gen) < 0.7 else (a + 1) % V for a in argmax[:k]]
        p = probs_from_logits(logits, SamplingParams(temperature=0.0))
        assert verify_sampled(drafted, None, p, seed=trial, position=trial) == verify_greedy(drafted, argmax)


def test_eos_inside_the_accepted_run_is_committed_and_cut() -> None:
    eos = 2
    verdict = verify_greedy([5, eos, 7, 8], [5, eos, 7, 8, 9])
    assert verdict.accepted == 4
    assert clip_to_stop(verdict.tokens, eos_ids={eos}, remaining=100) == ([5, eos], "eos")
    verdict = verify_sampled([5, eos, 7], None, peaked([5, eos, 7, 1]), seed=3, position=0)
    assert clip_to_stop(verdict.tokens, eos_ids={eos}, remaining=100) == ([5, eos], "eos")


def test_draft_zero_at_drafted_token_is_rejected() -> None:
    # q gives the drafted token probability 0 (it could not have drawn it): reject, recover from p.
    p = torch.full((2, 4), 0.25)
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    for seed in range(50):
        verdict = verify_sampled([0], q, p, seed=seed, position=0)
        assert verdict.accepted == 0 and verdict.extra_kind == RECOVERED
        assert verdict.extra_token in (0, 3)  # residual max(0, p - q) lives on {0, 3}


def test_target_zero_at_drafted_token_is_rejected() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(50):
        assert verify_sampled([0], q, p, seed=seed, position=3).tokens == [1]
        assert verify_sampled([0], None, p, seed=seed, position=3).tokens == [1]


def test_p_equals_q_always_accepts() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, V, generator=gen), -1)
    for seed in range(100):
        drafted = torch.multinomial(p[:3], 1, generator=gen).squeeze(-1).tolist()
        assert verify_sampled(drafted, p[:3].clone(), p, seed=seed, position=0).accepted == 3


def test_seeded_determinism() -> None:
    gen = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(9, V, generator=gen), -1)
    q = torch.softmax(torch.randn(8, V, generator=gen), -1)
    drafted = torch.multinomial(q, 1, generator=gen).squeeze(-1).tolist()
    same = [verify_sampled(drafted, q, p, seed=42, position=10) for _ in range(3)]
    assert same[0] == same[1] == same[2]
    outcomes = {tuple(verify_sampled(drafted, q, p, seed=s, position=10).tokens) for s in range(40)}
    assert len(outcomes) > 5  # different seeds give different draws
    positions = {tuple(verify_sampled(drafted, q, p, seed=42, position=pos).tokens) for pos in range(40)}
    assert len(positions) > 5  # and so do different positions


def test_batch_equals_one_at_a_time() -> None:
    gen = torch.Generator().manual_seed(3)
    drafted, qs, ps, seeds, positions = [], [], [], [], []
    for b in range(24):
        k = b % 9
        p = torch.softmax(torch.randn(k + 1, V, generator=gen) * 2, -1)
        q = torch.softmax(torch.randn(k, V, generator=gen) * 2, -1) if b % 3 else None
        d = torch.multinomial(q if q is not None else p[:k], 1, generator=gen).squeeze(-1).tolist() if k else []
        drafted.append(d)
        qs.append(q)
        ps.append(p)
        seeds.append(1000 + b)
        positions.append(b * 7)
    batch = verify_sampled_batch(drafted, qs, ps, seeds=seeds, positions=positions)
    single = [verify_sampled(d, q, p, seed=s, position=pos) for d, q, p, s, pos in zip(drafted, qs, ps, seeds, positions)]
    assert batch == single
    assert {v.extra_kind for v in batch} == {BONUS, RECOVERED}
    assert verify_sampled_batch([], [], [], seeds=[], positions=[]) == []


def test_bad_shapes_and_tokens_name_the_field() -> None:
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError, match="target_probs"):
        verify_sampled([1], None, p, seed=0, position=0)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampled([1, 2], p, p, seed=0, position=0)
    with pytest.raises(ValueError, match="drafted token 9"):
        verify_sampled([1, 9], None, p, seed=0, position=0)
    with pytest.raises(ValueError, match="one entry per session"):
        verify_sampled_batch([[1]], [None], [p, p], seeds=[0], positions=[0])


def test_k0_sampling_follows_target_row() -> None:
    p = torch.tensor([[0.0, 0.2, 0.0, 0.8]])
    draws = [verify_sampled([], None, p, seed=s, position=0).tokens[0] for s in range(2000)]
    assert set(draws) == {1, 3}
    assert 0.75 < draws.count(3) / len(draws) < 0.85


# --------------------------------------------------------------------- token trees


def test_a_tree_accepts_the_path_of_the_targets_tokens() -> None:
    from specdec.core.verify import verify_tree

    #            a    b    c    d    e
    drafted = [10, 11, 12, 13, 14]
    parents = [-1, -1, 0, 0, 2]  # a, b under the root; c, d under a; e under c
    # target[i]: the target's token after the root (i = 0) or after node i - 1.
    # a (10), then d (13) under a, then 52 after d (a leaf): a bonus token.
    v = verify_tree(drafted, parents, [10, 13, 0, 0, 52, 0])
    assert v.path == (0, 3) and v.tokens == [10, 13, 52] and v.extra_kind == "bonus" and v.ranks == (0, 1)
    # Nothing matches at the root: the target's own token, recovered (the root had children).
    v = verify_tree(drafted, parents, [7, 0, 0, 0, 0, 0])
    assert v.accepted == 0 and v.tokens == [7] and v.extra_kind == "recovered"
    # The deepest path: a, c, e, then the target's token after e.
    v = verify_tree(drafted, parents, [10, 12, 0, 14, 0, 77])  # after a: c; after c: e
    assert v.path == (0, 2, 4) and v.tokens == [10, 12, 14, 77] and v.extra_kind == "bonus"
    # A mismatch under c: recovered after c.
    v = verify_tree(drafted, parents, [10, 12, 0, 15, 0, 0])
    assert v.path == (0, 2) and v.tokens == [10, 12, 15] and v.extra_kind == "recovered"
    # A chain is the tree whose parents are -1, 0, 1, ...: the same verdict as greedy verification.
    from specdec.core.verify import verify_greedy
    chain, target = [4, 5, 6], [4, 5, 9, 1]
    assert verify_tree(chain, [-1, 0, 1], target).tokens == verify_greedy(chain, target).tokens
    with pytest.raises(ValueError):
        verify_tree([1, 2], [-1, 1], [0, 0, 0])

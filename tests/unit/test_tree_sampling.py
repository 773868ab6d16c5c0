"""Sampled token trees without a coupling: recursive rejection over siblings
(specdec.core.verify.verify_tree_sampled) gives the target's distribution, whatever the tree.

A fixed tree over a 6-token vocabulary with fixed target distributions per node: over 6,000
seeds, the first committed token follows p after the committed tokens, and the second one,
given the first is a drafted child, follows p after that child (chi-square). The control, a
sampler that draws from p instead of the residual after a rejection (the classic bug), fails
the same test.

Chance: seeds 1..6,000 are fixed, so given the code the outcome is deterministic. With fresh
seeds a correct sampler would fail one of the 2 checks with probability 2 x 1e-6
(tests.chance.FALSE_ALARM); the control's first-token statistic is 951 against a critical value
of 36 (5 degrees of freedom): it fails at any seed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core import rng
from specdec.core.rng import Purpose
from specdec.core.sampling import sample
from specdec.core.verify import BONUS, RECOVERED, verify_tree_sampled
from tests.chance import FALSE_ALARM

VOCAB, SEEDS, P_THRESHOLD = 6, 6000, FALSE_ALARM  # per check, for a fresh seed
# The committed tokens' children: 2, 4, 1; node 0 (token 2) has children 3, 5; node 1 (token 4) has 0.
DRAFTED = [2, 4, 1, 3, 5, 0]
PARENTS = [-1, -1, -1, 0, 0, 1]


def target_probs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(DRAFTED) + 1, VOCAB, generator=gen)
    logits[0, 2] += 1.5  # node 0 is often taken: the second token's test has draws
    return torch.softmax(logits, dim=-1)


def wrong_tree_sampler(drafted, parents, probs, *, seed, position):
    """The control: after a rejected sibling, the next test and the draw use p, not the residual."""
    node, tokens = -1, []
    while True:
        at, p = position + len(tokens), probs[node + 1].double()
        kids = [i for i, parent in enumerate(parents) if parent == node]
        nxt = next((c for r, c in enumerate(kids) if rng.uniform(seed, at, Purpose.ACCEPT, r) < float(p[drafted[c]])), None)
        if nxt is None:
            u = torch.tensor([rng.uniform(seed, at, Purpose.RESAMPLE)], dtype=torch.float64)
            return tokens + [int(sample(p[None], u)[0])]
        tokens.append(drafted[nxt])
        node = nxt


def first_two(sampler) -> tuple[np.ndarray, np.ndarray]:
    probs = target_probs()
    firsts, seconds = [], []
    for seed in range(1, SEEDS + 1):
        tokens = sampler(DRAFTED, PARENTS, probs, seed=seed, position=17)
        tokens = tokens.tokens if hasattr(tokens, "tokens") else tokens
        firsts.append(tokens[0])
        if tokens[0] == 2 and len(tokens) > 1:  # through node 0 (token 2)
            seconds.append(tokens[1])
    return np.array(firsts), np.array(seconds)


def pvalues(firsts: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    probs = target_probs().double().numpy()
    p1 = chisquare(np.bincount(firsts, minlength=VOCAB), probs[0] / probs[0].sum() * len(firsts)).pvalue
    p2 = chisquare(np.bincount(seconds, minlength=VOCAB), probs[1] / probs[1].sum() * len(seconds)).pvalue
    return float(p1), float(p2)


def test_recursive_rejection_over_siblings_has_the_target_distribution() -> None:
    firsts, seconds = first_two(verify_tree_sampled)
    p1, p2 = pvalues(firsts, seconds)
    print(f"\ntree sampling: first token p={p1:.4f}, second given the first child p={p2:.4f} "
          f"({len(seconds)} through node 0)")
    assert len(seconds) > 500
    assert p1 > P_THRESHOLD and p2 > P_THRESHOLD


def test_drawing_from_p_after_a_rejected_sibling_fails_the_same_test() -> None:
    p1, p2 = pvalues(*first_two(wrong_tree_sampler))
    print(f"\nwrong tree sampler: first token p={p1:.2e}, second p={p2:.2e}")
    assert min(p1, p2) < P_THRESHOLD


def test_a_verdict_walks_the_tree_and_retries_decide_the_same() -> None:
    probs = target_probs()
    seen_depth, kinds = set(), set()
    for seed in range(1, 300):
        v = verify_tree_sampled(DRAFTED, PARENTS, probs, seed=seed, position=5)
        assert v == verify_tree_sampled(DRAFTED, PARENTS, probs, seed=seed, position=5)
        assert len(v.tokens) == v.accepted + 1 and len(v.path) == len(v.ranks) == v.accepted
        for node, parent in zip(v.path, (-1, *v.path)):
            assert PARENTS[node] == parent  # a path down the tree
        assert [DRAFTED[i] for i in v.path] == v.tokens[:-1]
        seen_depth.add(v.accepted)
        kinds.add(v.extra_kind)
    assert seen_depth == {0, 1, 2} and kinds == {RECOVERED, BONUS}
    # One-hot rows: the tree's tokens where p is certain.
    certain = torch.zeros(len(DRAFTED) + 1, VOCAB)
    certain[0, 4], certain[2, 0], certain[6, 1] = 1.0, 1.0, 1.0
    v = verify_tree_sampled(DRAFTED, PARENTS, certain, seed=9, position=0)
    assert v.tokens == [4, 0, 1] and v.path == (1, 5) and v.extra_kind == BONUS
    with pytest.raises(ValueError, match="parents"):
        verify_tree_sampled(DRAFTED, PARENTS[:-1], probs, seed=1, position=0)

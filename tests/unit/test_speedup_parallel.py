"""The parallel-speculation speed-up model (specdec.core.speedup, parallel section)."""
from __future__ import annotations

import math
import random

import pytest

from specdec.core.speedup import (
    best_k, best_parallel_k, expected_tokens_per_pass, parallel_round_cost, parallel_speedup,
    pre_draft_hit_rate, speedup,
)


def test_hit_rate() -> None:
    assert pre_draft_hit_rate(0.5, 2) == 0.125  # alpha^k * beta, beta = alpha
    assert pre_draft_hit_rate(0.5, 2, beta=1.0) == 0.25
    assert pre_draft_hit_rate(0.9, 0) == 0.0  # nothing drafted, nothing to pre-draft
    with pytest.raises(ValueError, match="beta"):
        pre_draft_hit_rate(0.5, 2, beta=1.5)


def test_round_cost_and_speedup() -> None:
    a, k, c, v = 0.6, 3, 0.1, 1.2
    h = a ** (k + 1)
    assert math.isclose(parallel_round_cost(a, k, c, v), v + (1 - h) * k * c)  # the pre-draft fits in v
    # Sequential mode is the h = 0 case: never a hit.
    assert math.isclose(parallel_round_cost(0.0, k, c, v), v + k * c)
    assert math.isclose(parallel_speedup(0.0, k, c, v), speedup(0.0, k, c, v))
    # A pre-draft longer than the verify makes a hit round wait for the rest.
    slow = parallel_round_cost(1.0, 2, 0.6, 1.0, c0=0.1)
    assert math.isclose(slow, 1.0 + (0.1 + 3 * 0.6 - 1.0))
    # Parallel never loses to sequential, and gains most where full acceptance is likely.
    for alpha in (0.2, 0.43, 0.8, 0.95):
        for kk in range(1, 9):
            assert parallel_speedup(alpha, kk, 0.1, 1.0) >= speedup(alpha, kk, 0.1, 1.0) - 1e-12
    gain = [parallel_speedup(0.43, kk, 0.1) / speedup(0.43, kk, 0.1) for kk in (1, 2, 4, 8)]
    assert gain == sorted(gain, reverse=True)
    assert math.isclose(parallel_speedup(1.0, 4, 0.1, 1.0), 5 / 1.0)  # always a hit: the draft is hidden


def test_best_parallel_k_shifts_down() -> None:
    v = lambda k: 1.0 + 0.17 * k  # noqa: E731 - this CPU: verify grows ~17% of a pass per token
    assert best_parallel_k(0.43, 0.09, v) == 1  # this CPU (issue 11 figures): k = 1
    assert best_parallel_k(0.0, 0.09, v) == 0
    # Hits favour full acceptance, so the best k shifts down (or stays), and parallel at its
    # best k is at least as fast as sequential at its own.
    for alpha, c in ((0.8, 0.1), (0.9, 0.05), (0.7, 0.15), (0.9, 0.3)):
        kp, ks = best_parallel_k(alpha, c, 1.0), best_k(alpha, c, 1.0)
        assert kp <= ks
        assert parallel_speedup(alpha, kp, c, 1.0) >= speedup(alpha, ks, c, 1.0)


def test_monte_carlo_agrees_with_the_formula() -> None:
    """Simulate rounds: i.i.d. acceptance, the draft's bonus guess right with prob beta."""
    rnd = random.Random(5)
    alpha, beta, k, c, c0, v = 0.55, 0.4, 2, 0.12, 0.05, 1.3
    tokens = cost = 0.0
    hit = False
    for _ in range(200_000):
        cost += v + (max(0.0, c0 + (k + 1) * c - v) if hit else c0 + k * c)
        m = 0
        while m < k and rnd.random() < alpha:
            m += 1
        tokens += m + 1
        hit = m == k and rnd.random() < beta
    assert math.isclose(tokens / cost, parallel_speedup(alpha, k, c, v, c0=c0, beta=beta), rel_tol=0.01)
    assert math.isclose(tokens / 200_000, expected_tokens_per_pass(alpha, k), rel_tol=0.01)

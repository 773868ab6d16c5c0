"""Speed-up arithmetic and the online acceptance estimator."""
from __future__ import annotations

import math
import random

import pytest

from specdec.core.speedup import AcceptanceEstimator, best_k, break_even_alpha, expected_tokens_per_pass, speedup


def test_expected_tokens_per_pass() -> None:
    assert expected_tokens_per_pass(0.0, 5) == 1.0
    assert expected_tokens_per_pass(1.0, 5) == 6.0
    assert math.isclose(expected_tokens_per_pass(0.5, 2), 1 + 0.5 + 0.25)
    # Matches the direct sum 1 + a + ... + a^k.
    for a in (0.1, 0.6, 0.9, 0.999999):
        assert math.isclose(expected_tokens_per_pass(a, 7), sum(a**i for i in range(8)), rel_tol=1e-9)


def test_speedup_and_best_k() -> None:
    assert speedup(0.8, 0, 0.1) == 1.0
    assert math.isclose(speedup(0.8, 4, 0.1), (1 - 0.8**5) / 0.2 / 1.4)
    # Paper's example regime: alpha 0.8, cheap draft -> k around 4-8; useless draft -> k = 0.
    assert 3 <= best_k(0.8, 0.05) <= 10
    assert best_k(0.0, 0.05) == 0
    assert best_k(1.0, 0.0, k_max=12) == 12
    k = best_k(0.7, 0.1)
    assert all(speedup(0.7, k, 0.1) >= speedup(0.7, j, 0.1) for j in range(17))


def test_break_even_alpha() -> None:
    a = break_even_alpha(4, 0.1)
    assert a is not None and math.isclose(speedup(a, 4, 0.1), 1.0, rel_tol=1e-9)
    assert break_even_alpha(4, 1.5) is None  # 5 tokens at best, for 7 passes of cost: never pays
    assert break_even_alpha(2, 0.0) == 0.0
    with pytest.raises(ValueError, match="alpha"):
        speedup(1.5, 1, 0.1)


def test_estimator_recovers_alpha() -> None:
    rnd = random.Random(0)
    for true_alpha in (0.3, 0.8):
        est = AcceptanceEstimator(halflife=2000)
        for _ in range(4000):
            k = 5
            m = 0
            while m < k and rnd.random() < true_alpha:
                m += 1
            est.observe(k, m)
        assert abs(est.alpha - true_alpha) < 0.03
        assert all(abs(r - true_alpha) < 0.05 for r in est.per_position)
        assert est.rounds == 4000


def test_estimator_tracks_drift_and_counts_positions() -> None:
    est = AcceptanceEstimator(halflife=16)
    for _ in range(100):
        est.observe(4, 4)
    assert est.alpha > 0.95
    for _ in range(100):
        est.observe(4, 0)
    assert est.alpha < 0.1
    assert est.tested_at == [200, 100, 100, 100]
    assert est.accepted_at == [100, 100, 100, 100]
    assert est.acceptance_rate == 0.5
    est.observe(0, 0)  # an empty draft tests nothing
    assert est.tested_at[0] == 200
    with pytest.raises(ValueError, match="n_accepted"):
        est.observe(2, 3)

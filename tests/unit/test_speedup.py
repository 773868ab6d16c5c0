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


# ---------------------------------------------------------------------------- goodput k under load

from specdec.core.speedup import (  # noqa: E402
    GoodputPolicy, RoundCosts, best_goodput_k, expected_committed, goodput, interpolate_cost,
)


def cpu_verify(tokens: float) -> float:
    """A CPU-like target: 60 ms for one token, +7 ms per token (16 rows x 1 token ~ 2.75x one row)."""
    return 53.0 + 7.0 * tokens


def test_expected_committed_by_position() -> None:
    assert expected_committed([], 4) == 1.0
    assert expected_committed([0.9, 0.5], 0) == 1.0
    assert math.isclose(expected_committed([0.9, 0.5], 2), 1 + 0.9 + 0.45)
    assert math.isclose(expected_committed([0.9, 0.5], 3), 1 + 0.9 + 0.45 + 0.225)  # the last rate repeats
    assert math.isclose(expected_committed([0.7], 5), expected_tokens_per_pass(0.7, 5))


def test_interpolate_cost() -> None:
    pts = [(1, 60.0), (4, 62.0), (16, 150.0)]
    assert interpolate_cost(pts, 1) == 60.0 and interpolate_cost(pts, 4) == 62.0
    assert math.isclose(interpolate_cost(pts, 10), 62.0 + 88.0 * 6 / 12)
    assert math.isclose(interpolate_cost(pts, 20), 150.0 + 88.0 / 12 * 4)  # the last segment's slope
    assert interpolate_cost(pts, 0.5) < 60.0
    # Not forced monotone (2-3 rows can take a slower kernel than 5), but never extrapolated downwards.
    assert interpolate_cost([(1, 60.0), (2.5, 100.0), (5, 90.0)], 5) == 90.0
    assert interpolate_cost([(1, 60.0), (2.5, 100.0), (5, 90.0)], 13) > 90.0
    # One point: the prior shape (flat_tokens + T).
    assert math.isclose(interpolate_cost([(1, 9.0)], 17, flat_tokens=8.0), 9.0 * 25 / 9)
    with pytest.raises(ValueError):
        interpolate_cost([], 1)


def test_low_load_and_high_acceptance_drafts() -> None:
    costs = RoundCosts(verify_ms=cpu_verify, rows=1, draft_step_ms=6.0, draft_call_ms=1.0, round_ms=2.0)
    k = best_goodput_k([0.85] * 8, costs, k_max=8)
    assert k >= 3
    assert goodput([0.85] * 8, k, costs) > goodput([0.85] * 8, 0, costs) * 1.5
    assert best_goodput_k([0.05] * 8, costs, k_max=8) == 0  # a useless draft: never a loss


def compute_bound(tokens: float) -> float:
    """Past 4 rows every token costs the same (the minimum-rows padding makes 1-4 equal)."""
    return 15.0 * max(tokens, 4.0)


def test_compute_bound_load_does_not_draft() -> None:
    # A realistic acceptance on the CPU-like target with 16 sessions in the forward: k = 0.
    loaded = RoundCosts(verify_ms=cpu_verify, rows=16, draft_step_ms=6.0, draft_call_ms=1.0, round_ms=2.0)
    assert best_goodput_k([0.6] * 8, loaded, k_max=8) == 0
    # At that load a very good draft still earns k = 1 there (1.85 tokens for 1.7x the forward) ...
    assert best_goodput_k([0.85] * 8, loaded, k_max=8) == 1
    # ... but not once the verify is compute-bound (cost proportional to tokens).
    bound = RoundCosts(verify_ms=compute_bound, rows=16, draft_step_ms=6.0, draft_call_ms=1.0, round_ms=2.0)
    assert best_goodput_k([0.95] * 8, bound, k_max=8) == 0
    # The same single session drafts on it: 4 tokens cost no more than 1.
    assert best_goodput_k([0.85] * 8, RoundCosts(verify_ms=compute_bound, rows=1, draft_step_ms=3.0), 8) >= 2
    # A memory-bound verify (flat in tokens, e.g. a GPU) keeps drafting at the same load.
    flat = RoundCosts(verify_ms=lambda t: 20.0 + 0.01 * t, rows=16, draft_step_ms=2.0)
    assert best_goodput_k([0.85] * 8, flat, k_max=8) >= 3
    # With few sessions in the forward drafting still pays.
    light = RoundCosts(verify_ms=cpu_verify, rows=2, draft_step_ms=6.0, draft_call_ms=1.0, round_ms=2.0)
    assert best_goodput_k([0.85] * 8, light, k_max=8) > 0


def test_policy_probes_at_k0_and_returns_to_drafting() -> None:
    policy = GoodputPolicy(probe_every=4, probe_max=8, probe_k=2)
    assert policy.choose(None, 8) == 2  # nothing measured: the start k
    loaded = RoundCosts(verify_ms=compute_bound, rows=16, draft_step_ms=6.0)
    ks = []
    for _ in range(28):
        k = policy.choose(loaded, 8)
        ks.append(k)
        policy.observe(k, k)  # everything drafted is accepted
    # A probe after 4 rounds at k = 0, then the wait doubles to 8 (the most here).
    assert ks == [0, 0, 0, 2] + [0] * 7 + [2] + [0] * 7 + [2] + [0] * 7 + [2] and policy.probes == 4
    idle = RoundCosts(verify_ms=cpu_verify, rows=1, draft_step_ms=6.0)
    assert policy.choose(idle, 8) >= 4  # load gone, acceptance measured high by the probes
    assert policy.choose(loaded, 0) == 0


def test_pooled_acceptance_is_a_new_sessions_prior() -> None:
    from specdec.core.speedup import PooledAcceptance

    pooled = PooledAcceptance()
    assert pooled.rate(0) is None
    for _ in range(50):
        pooled.observe(4, 4)  # earlier sessions accepted everything
    assert pooled.rate(0) > 0.99 and pooled.rate(7) > 0.99
    costs = RoundCosts(verify_ms=cpu_verify, rows=1, draft_step_ms=6.0, draft_call_ms=1.0, round_ms=2.0)
    fresh, informed = GoodputPolicy(), GoodputPolicy()
    informed.pooled = pooled
    k_fresh, k_informed = fresh.choose(costs, 8), informed.choose(costs, 8)
    assert k_fresh <= 1 and k_informed >= 4  # the 0.5 prior vs what the pool measured
    informed.observe(4, 0)  # this session's own rounds count, and feed the pool
    assert pooled.tested[0] > pooled.tested[1]


def test_a_trees_size_follows_the_verify_cost_surface() -> None:
    from specdec.core.speedup import RoundCosts, tree_size

    def costs(rows: float, per_token: float) -> RoundCosts:
        return RoundCosts(verify_ms=lambda t: 40.0 + per_token * t, rows=rows)

    assert tree_size(None, 4, 16) == 16  # nothing measured: the budget
    assert tree_size(costs(1, 0.5), 4, 16) == 16  # a flat surface (one row on a CPU): the whole budget
    # 40 + 2.5 (n + 1) <= 1.25 (40 + 12.5): n + 1 <= 10.25
    assert tree_size(costs(1, 2.5), 4, 16) == 9
    # Eight rows on a compute-bound target: every row's extra tokens cost all of them; the tree
    # shrinks to about the chain (40 + 20 (n + 1) <= 1.25 x 140).
    assert tree_size(costs(8, 2.5), 4, 16) == 5
    assert tree_size(RoundCosts(verify_ms=lambda t: 10.0 * t, rows=16), 8, 16) == 10  # linear: n + 1 <= 11.25
    assert tree_size(costs(1, 0.5), 0, 16) == 0 and tree_size(costs(1, 0.5), 4, 4) == 0

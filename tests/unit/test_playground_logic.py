"""The playground's pure parts: the pass quota, the sampling panel's samplers and test, the
speed-up table (gateway.playground.quota, gateway.playground.panel, gateway.playground.speedup_table)."""
from __future__ import annotations

import pytest
import torch

from gateway.playground import panel
from gateway.errors import APIError
from gateway.playground import RunCache, PredictBody, speedup_table
from gateway.playground.quota import PassQuota, QuotaExhausted
from specdec.core import speedup
from tests.chance import FALSE_ALARM


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_31st_pass_of_a_minute_is_refused_and_frees_up_as_the_minute_goes() -> None:
    clock = Clock()
    quota = PassQuota(30, 60.0, clock=clock)
    for _ in range(30):
        quota.reserve("a", 1).settle(1)
        clock.now += 1
    with pytest.raises(QuotaExhausted) as err:
        quota.reserve("a", 1)
    assert "30 target passes per minute" in str(err.value)
    assert err.value.retry_after_s == 30  # the first pass (t=1000) leaves the window at t=1060
    assert quota.remaining("b") == 30  # per visitor
    clock.now = 1060.0
    assert quota.remaining("a") == 1
    quota.reserve("a", 5).settle(1)
    assert quota.remaining("a") == 0


def test_a_reservation_grants_what_is_left_and_settles_what_was_used() -> None:
    clock = Clock()
    quota = PassQuota(30, 60.0, clock=clock)
    quota.reserve("a", 20).settle(20)
    r = quota.reserve("a", 64)  # a generation asking for up to 64 tokens gets the 10 left
    assert r.granted == 10 and quota.remaining("a") == 0
    with pytest.raises(QuotaExhausted):  # a concurrent request while they are reserved
        quota.reserve("a", 1)
    r.settle(4)  # the run used 4: the other 6 come back at once
    assert quota.remaining("a") == 6
    r.settle(9)  # settling twice changes nothing
    assert quota.remaining("a") == 6
    quota.reserve("a", 3).settle(0)  # a cached run costs nothing
    assert quota.remaining("a") == 6
    assert PassQuota(0).reserve("x", 500).granted == 500  # 0 = no quota


def test_run_cache_is_lru_and_keyed_by_the_whole_request() -> None:
    cache = RunCache(2)
    a, b, c = (RunCache.key("predict", PredictBody(text=t)) for t in "abc")
    assert a != RunCache.key("predict", PredictBody(text="a", top_k=3))
    cache.put(a, 1), cache.put(b, 2)
    assert cache.get(a) == 1
    cache.put(c, 3)  # b is the least recently used
    assert cache.get(b) is None and cache.get(a) == 1 and cache.get(c) == 3


def _pq(seed: int = 0, vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)
    return p, q


def test_exact_draws_follow_p_and_the_wrong_sampler_is_caught() -> None:
    """Seed 11 is fixed: given the code the outcome is deterministic. For a fresh seed a correct
    sampler fails each of the 2 checks with probability 1e-6 (tests.chance.FALSE_ALARM); the wrong
    sampler's statistic against p is 987 against a critical value of 47 (10 degrees of freedom):
    it is caught at any seed."""
    p, q = _pq()
    draws = 8000
    exact = panel.draw_first_tokens(p, q, draws, seed=11)
    wrong = panel.draw_first_tokens(p, q, draws, seed=11, sampler=panel.WRONG)
    test = panel.chi_square(panel.bins_of(p, exact), draws)
    assert test.p_value > FALSE_ALARM, test
    caught = panel.chi_square(panel.bins_of(p, wrong), draws)
    assert caught.p_value < FALSE_ALARM, caught
    # The control is the sampler the module says: min(p, q) + (1 - sum min(p, q)) p.
    m = torch.minimum(p, q)
    biased = m + (1 - m.sum()) * p
    assert panel.chi_square(panel.bins_of(biased, wrong), draws).p_value > FALSE_ALARM
    # The draws are a function of the seed.
    assert torch.equal(exact, panel.draw_first_tokens(p, q, draws, seed=11))


def test_bins_keep_every_draw_and_enough_expected_per_bin() -> None:
    p, q = _pq(1, vocab=40)
    tokens = panel.draw_first_tokens(p, q, 300, seed=3)
    bins = panel.bins_of(p, tokens, top=10)
    assert sum(b.count for b in bins) == 300
    assert sum(len(b.ids) for b in bins) == 40
    assert sum(b.p for b in bins) == pytest.approx(1.0, abs=1e-5)
    assert all(b.p * 300 >= panel.MIN_EXPECTED for b in bins)


def test_chi_square_p_value_matches_scipy() -> None:
    from scipy.stats import chi2

    bins = [panel.Bin((0,), 0.5, 60), panel.Bin((1,), 0.3, 25), panel.Bin((2,), 0.2, 15)]
    test = panel.chi_square(bins, 100)
    assert test.dof == 2
    assert test.statistic == pytest.approx((10**2 / 50) + (5**2 / 30) + (5**2 / 20))
    assert test.p_value == pytest.approx(chi2.sf(test.statistic, 2), rel=1e-9)


def test_speedup_table_is_the_core_model_and_rejects_bad_values() -> None:
    table = speedup_table(0.7, 4, 0.1, 1.2)
    assert table["speedup"] == speedup.speedup(0.7, 4, 0.1, 1.2)
    assert table["best_k"] == speedup.best_k(0.7, 0.1, 1.2)
    assert [p["speedup"] for p in table["over_k"]] == [speedup.speedup(0.7, k, 0.1, 1.2) for k in range(17)]
    assert table["over_alpha"][-1]["speedup"] == speedup.speedup(1.0, 4, 0.1, 1.2)
    for bad, field in [((1.5, 4, 0.1, 1.0), "alpha"), ((0.5, 17, 0.1, 1.0), "k"),
                       ((0.5, 4, -1, 1.0), "c"), ((0.5, 4, 0.1, 0.0), "v")]:
        with pytest.raises(APIError) as err:
            speedup_table(*bad)
        assert err.value.status == 400 and err.value.param == field

"""The coupled sampler (specdec.core.sampling.coupled_draws) and its noise (specdec.core.rng).

Gumbel-max with counter-based noise: the noise is a pure function of (seed,
position, token), the torch version agrees with the numpy specification on
every bit of its uniforms, a draw is exactly distributed as the row's softmax
(chi-square, with a wrongly scaled noise as the control that must fail), and a
row's draw does not depend on the rows computed with it.

Chance: the keys are fixed, so given the code every outcome here is deterministic. With fresh
keys a correct sampler would fail the 3 chi-square checks with probability 1e-6 each
(tests.chance.FALSE_ALARM) and the noise's mean and spread checks (5.2 and 5.0 standard errors
wide) with 2e-7 and 6e-7: below 4e-6 for the file. The control's statistic is 612 against a
critical value of 49 (11 degrees of freedom): it fails at any key.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine import sampler
from engine.plan import OutputSpec, RowPlan
from specdec.core import rng
from specdec.core.sampling import SamplingParams, coupled_draws, probs_from_logits, sampling_logits
from tests.chance import FALSE_ALARM

torch.set_num_threads(1)
P_THRESHOLD = FALSE_ALARM  # per check, for fresh keys


def _keys(seed: int, positions) -> list[int]:
    return [int(k) for k in rng.gumbel_keys(seed, np.asarray(positions))]


def test_keys_are_a_pure_function_of_seed_and_position() -> None:
    assert _keys(5, [3, 4]) == _keys(5, [3, 4])
    keys = {k for s in range(20) for k in _keys(s, range(50))}
    assert len(keys) == 20 * 50
    # Distinct from every other purpose's stream at the same coordinates.
    assert rng.gumbel_keys(5, 3) != rng.uniforms(5, 3, rng.Purpose.RESAMPLE)


def test_torch_noise_matches_the_numpy_specification() -> None:
    for seed in (1, 2**63 + 5, 123456789):
        keys = rng.gumbel_keys(seed, np.arange(0, 5000, 997))
        want = rng.gumbel_noise_reference(keys, 4099)
        got = np.stack([rng.gumbel_noise(int(k), 4099).numpy() for k in keys])
        # The uniforms' bits agree exactly (the logarithms to their last bits): recover u from G.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        assert np.array_equal(np.exp(-np.exp(-got)) > 0.5, np.exp(-np.exp(-want)) > 0.5)


def test_noise_is_standard_gumbel() -> None:
    g = rng.gumbel_noise(int(rng.gumbel_keys(3, 9)), 200_000).numpy()
    # Standard errors over 200,000 draws: 0.0029 for the mean, 0.0030 for the standard deviation
    # (excess kurtosis 2.4); 0.015 is about 5 of them (a fresh key: below 1e-6 for both).
    assert abs(g.mean() - np.euler_gamma) < 0.015 and abs(g.std() - np.pi / np.sqrt(6)) < 0.015
    assert np.isfinite(g).all()


def _chi_square(draws: np.ndarray, p: np.ndarray) -> float:
    """Over the support of p (draws outside it are asserted on separately)."""
    counts = np.bincount(draws, minlength=len(p))
    support = p > 0
    p = p[support] / p[support].sum()
    return float(chisquare(counts[support], p * counts[support].sum()).pvalue)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["t0.7", "topk", "topp"])
def test_coupled_draws_have_the_rows_distribution(params: SamplingParams) -> None:
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(4)) * 2
    p = probs_from_logits(logits, params)[0].double().numpy()
    scores = sampling_logits(logits, params)
    keys = _keys(7, range(6000))
    draws = np.array([int(coupled_draws(scores, [k])[0]) for k in keys])
    assert (p[draws] > 0).all()  # never a token outside the top-k / nucleus
    assert _chi_square(draws, p) > P_THRESHOLD


def test_a_wrongly_scaled_noise_fails_the_same_test() -> None:
    """The control: Gumbel noise at 0.7x its scale samples softmax(x / 0.7), not softmax(x)."""
    params = SamplingParams(temperature=0.7)
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(4)) * 2
    p = probs_from_logits(logits, params)[0].double().numpy()
    scores = sampling_logits(logits, params)[0].double()
    draws = np.array([int(torch.argmax(scores + 0.7 * rng.gumbel_noise(k, 12))) for k in _keys(7, range(6000))])
    assert _chi_square(draws, p) < P_THRESHOLD


def test_a_rows_draw_does_not_depend_on_the_rows_beside_it() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    params = SamplingParams(temperature=0.9)
    keys = _keys(11, range(40, 45))
    together = coupled_draws(sampling_logits(logits, params), keys).tolist()
    alone = [int(coupled_draws(sampling_logits(logits[i:i + 1], params), [keys[i]])[0]) for i in range(5)]
    assert together == alone


def test_the_engine_sampler_draws_each_row_at_its_absolute_positions() -> None:
    """Rows of a forward: each emitted position i draws with the noise of the token it predicts
    (past + len(tokens) - emit + 1 + i), whoever shares the forward; greedy rows stay argmax."""
    gen = torch.Generator().manual_seed(2)
    vocab = 50
    params = SamplingParams(temperature=1.0)
    rows = [RowPlan(None, [1, 2, 3], past=10, emit=2, output=OutputSpec(params, coupled_seed=9, logprobs=2)),
            RowPlan(None, [4], past=7, emit=1, output=OutputSpec(params, coupled_seed=3)),
            RowPlan(None, [5, 6], past=0, emit=1, output=OutputSpec(SamplingParams(), coupled_seed=3))]
    logits = torch.randn(4, vocab, generator=gen)
    outs = sampler.outputs(rows, logits.clone())
    assert outs[0].sampled == coupled_draws(sampling_logits(logits[0:2], params), _keys(9, [12, 13])).tolist()
    assert outs[1].sampled == coupled_draws(sampling_logits(logits[2:3], params), _keys(3, [8])).tolist()
    assert outs[2].sampled is None and outs[2].argmax == [int(logits[3].argmax())]
    lp = torch.log_softmax(logits[0:2] / 1.0, dim=-1)
    assert outs[0].logprobs.sampled == pytest.approx([float(lp[i, t]) for i, t in enumerate(outs[0].sampled)],
                                                      abs=1e-5)
    alone = sampler.outputs(rows[1:2], logits[2:3].clone())
    assert alone[0].sampled == outs[1].sampled

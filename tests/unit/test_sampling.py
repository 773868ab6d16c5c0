"""Sampling transforms (temperature, top-k, top-p, min-p) and the inverse-CDF sampler."""
from __future__ import annotations

import math

import pytest
import torch

from specdec.core.sampling import SamplingParams, probs_from_logits, sample

torch.set_num_threads(1)
NEG = float("-inf")


def test_greedy_is_one_hot_at_first_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [NEG, NEG, 2.0, NEG]])
    p = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert p.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))


def test_top_k() -> None:
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.2]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0] > 0).tolist() == [False, True, False, True, False]
    assert math.isclose(p.sum().item(), 1.0, rel_tol=1e-6)
    big = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=99))  # > vocab: off
    assert torch.allclose(big, torch.softmax(logits, -1))


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda top_p: (probs_from_logits(logits, SamplingParams(1.0, top_p=top_p))[0] > 0).tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False, False]
    assert keep(0.6) == [True, True, False, False]
    assert keep(0.9) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]
    assert keep(1e-6) == [True, False, False, False]  # the top token always survives
    p = probs_from_logits(logits, SamplingParams(1.0, top_p=0.9))
    assert torch.allclose(p[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_min_p() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])
    p = probs_from_logits(probs.log(), SamplingParams(1.0, min_p=0.1))
    assert (p[0] > 0).tolist() == [True, True, True, False]


def test_degenerate_rows() -> None:
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.8)
    logits = torch.tensor([[NEG, NEG, 1.0, NEG], [NEG, NEG, NEG, NEG], [0.0, 0.0, 0.0, 0.0]])
    p = probs_from_logits(logits, params)
    assert not torch.isnan(p).any()
    assert p[0].tolist() == [0, 0, 1, 0]  # all but one masked
    assert torch.allclose(p[1], torch.full((4,), 0.25))  # all -inf: uniform, not NaN
    assert torch.allclose(p.sum(-1), torch.ones(3))


def test_vectorised_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 30, generator=gen)
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.85, min_p=0.02)
    together = probs_from_logits(logits, params)
    alone = torch.cat([probs_from_logits(row[None], params) for row in logits])
    assert torch.allclose(together, alone)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": 1.0}, "min_p")],
)
def test_validate_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_sample_inverse_cdf_and_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9, 1.0 - 2**-53])
    assert sample(probs, u).tolist() == [1, 1, 3, 3, 3]
    # Unnormalised rows (a residual) are scaled by their total.
    assert sample(torch.tensor([[0.0, 0.1, 0.3]]), torch.tensor([0.3])).tolist() == [2]


def test_sample_keeps_tiny_masses_at_large_vocab() -> None:
    # One token with mass 1e-9 among 49,152: its CDF step must survive (float64 CDF).
    probs = torch.zeros(1, 49152, dtype=torch.float64)
    probs[0, :-1] = (1 - 1e-9) / 49151
    probs[0, -1] = 1e-9
    u = torch.tensor([1 - 5e-10], dtype=torch.float64)
    assert sample(probs, u).item() == 49151


def reference_top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:  # [n, vocab] bool
    """Top-p by a full descending sort (the textbook definition) of the same float32 softmax."""
    p = torch.softmax(logits.float(), -1).double()
    sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = before < top_p
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0, 30.0])  # flat ... very peaked rows
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_full_sort_reference(scale: float, top_p: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 100 + top_p * 1000))
    logits = torch.randn(7, 5000, generator=gen, dtype=torch.float64) * scale
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    assert torch.equal(got, reference_top_p_keep(logits, top_p))


def test_top_p_with_ties_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, NEG]])
    # Softmax mass: 0.447, 0.164 x3, 0.060: for top-p 0.6 the mass before the second
    # tied token (0.611) already reaches 0.6, so ties are split by token id, as a
    # stable descending sort would.
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert (p[0] > 0).tolist() == [True, True, False, False, False, False]
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.99))
    assert (p[0] > 0).tolist() == [True, True, True, True, False, False]  # top-k keeps all ties

"""Sampling transforms: logits -> the distribution the sampler actually draws from.

Order follows the common convention: temperature, top-k, top-p (nucleus), min-p.
Every function is vectorised over positions (`[n, vocab]`) and keeps the
tensor's device, so the same code serves CPU and GPU hosts.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core import rng

# The smallest non-zero temperature. Logits are divided by it in float32: at
# 1e-40 (a float32 denormal) ordinary logits overflow to inf and softmax turns
# them into NaN; from 1e-6 up, logits up to 1e32 stay finite, and the
# distribution is already one-hot for any logit gap above ~1e-4.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """What the caller asked for. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        t = self.temperature
        if not math.isfinite(t) or (t != 0.0 and not t >= MIN_TEMPERATURE):
            raise ValueError(f"sampling.temperature must be 0 (greedy) or a finite number "
                             f">= {MIN_TEMPERATURE:g}, got {t}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1), got {self.min_p}")


def probs_from_logits(
    logits: torch.Tensor,  # [n, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [n, vocab] float32, rows sum to 1
    """The sampling distribution for each row of `logits`.

    Greedy rows are one-hot at the argmax (first index on ties), so greedy
    and sampled verification share one code path. A row whose logits are all
    -inf becomes uniform rather than NaN.
    """
    if params.greedy:
        out = torch.zeros_like(logits, dtype=torch.float32)
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    return torch.softmax(sampling_logits(logits, params), dim=-1)


def sampling_logits(
    logits: torch.Tensor,  # [n, vocab]
    params: SamplingParams,  # sampled (temperature > 0)
) -> torch.Tensor:  # [n, vocab] float32: softmax of a row is its sampling distribution
    """The logits the sampler draws from: divided by the temperature, -inf outside the top-k,
    the nucleus and the min-p floor. A row whose logits are all -inf becomes all zeros (uniform)."""
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    # A row with every logit -inf would turn into NaN below: sample it uniformly.
    all_masked = torch.isneginf(x.amax(dim=-1, keepdim=True))  # [n, 1]
    any_masked = bool(all_masked.any())
    if any_masked:
        x = torch.where(all_masked, torch.zeros_like(x), x)
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = x.masked_fill(_nucleus_drop(torch.softmax(x, dim=-1), params.top_p), float("-inf"))
    if params.min_p > 0.0:
        p = torch.softmax(x, dim=-1)
        floor = params.min_p * p.max(dim=-1, keepdim=True).values
        x = x.masked_fill(p < floor, float("-inf"))
    if any_masked:
        x = torch.where(all_masked, torch.zeros_like(x), x)
    return x


def coupled_draws(
    scores: torch.Tensor,  # [n, vocab] sampling_logits (or log-probabilities) of n positions
    keys: Sequence[int],  # [n] specdec.core.rng.gumbel_keys(seed, position) of each row
) -> torch.Tensor:  # [n] int64, on scores' device
    """The coupled sampler: row i's token is argmax_v (scores[i, v] + G(keys[i], v)).

    Gumbel-max: with standard Gumbel noise G the argmax is distributed as
    softmax(scores[i]), so this is exact sampling. The noise is a pure function
    of (seed, position, token), so every party that draws position P with the
    same seed uses the same noise: the target's draw at P is the same whatever
    was drafted (and the draft, drawing with that noise from its own scores,
    agrees with it as often as a shared-noise coupling allows). Tokens at -inf
    are never drawn. Row by row in float64, so a row's draw never depends on the
    other rows.
    """
    if len(keys) != scores.shape[0]:
        raise ValueError(f"keys: one per row of scores ({scores.shape[0]}), got {len(keys)}")
    vocab = scores.shape[-1]
    draws = [torch.argmax(scores[i].double() + rng.gumbel_noise(key, vocab, scores.device))
             for i, key in enumerate(keys)]
    return torch.stack(draws) if draws else torch.zeros(0, dtype=torch.int64, device=scores.device)


# Nucleus buckets: the top 11 bits of a non-negative float32 (8 exponent bits,
# 3 mantissa bits) order it monotonically: 8 buckets per octave of probability.
_BUCKET_SHIFT = 20
_NUM_BUCKETS = 1 << (31 - _BUCKET_SHIFT)


def _nucleus_drop(
    p: torch.Tensor,  # [n, vocab] float32 probabilities, no NaN
    top_p: float,
) -> torch.Tensor:  # [n, vocab] bool: True = outside the nucleus
    """Top-p without sorting the vocabulary.

    The rule (as with a stable descending sort): drop a token when the mass of
    the tokens ranked before it already reaches top_p; the top token always
    survives. A full sort of 49k entries costs milliseconds per row on a CPU,
    so instead: bucket tokens by the leading bits of their probability (8
    buckets per octave), sum the mass per bucket, find the one bucket where the
    cumulative mass crosses top_p — every bucket of larger probabilities is
    kept, every smaller one dropped — and sort only that bucket's tokens (all
    rows' at once).
    """
    n = p.shape[0]
    p = p.float().contiguous()
    key = (p.view(torch.int32) >> _BUCKET_SHIFT).long()  # [n, vocab], larger p -> larger key
    mass = torch.zeros(n, _NUM_BUCKETS, device=p.device).scatter_add_(1, key, p)
    mass = mass.double().flip(-1)  # bucket j = key NUM_BUCKETS - 1 - j: largest probabilities first
    cum = mass.cumsum(dim=-1)
    cut = (cum < top_p).sum(dim=-1, keepdim=True).clamp_(max=_NUM_BUCKETS - 1)  # [n, 1]
    above = (cum - mass).gather(1, cut)  # [n, 1] mass of larger-probability buckets
    cut_key = (_NUM_BUCKETS - 1) - cut  # [n, 1] the bucket where the cumulative mass crosses top_p
    drop = key < cut_key
    rows, cols = (key == cut_key).nonzero(as_tuple=True)  # row-major
    vals = p[rows, cols].double()
    # By row, then descending probability (stable: lower token id first on ties).
    order = torch.argsort(rows.double() * 2.0 - vals, stable=True)
    rows, cols, vals = rows[order], cols[order], vals[order]
    row_mass = torch.zeros(n, dtype=torch.float64, device=p.device).index_add_(0, rows, vals)
    earlier_rows = row_mass.cumsum(0) - row_mass  # candidates' mass of the rows before
    before = above[rows, 0] + (vals.cumsum(0) - vals) - earlier_rows[rows]
    drop[rows, cols] = before >= top_p
    return drop


def sample(
    probs: torch.Tensor,  # [n, vocab], rows sum to 1 (up to rounding)
    uniforms: torch.Tensor,  # [n], each in [0, 1)
) -> torch.Tensor:  # [n] int64
    """Inverse-CDF draw of one token per row from externally supplied uniforms.

    Deterministic given its inputs (the randomness lives in specdec.core.rng).
    Rows need not be normalised (the CDF is scaled by the row's total), so a
    residual max(0, p - q) can be passed as is. A token of probability 0 is
    never returned. The CDF is accumulated in float64 so tokens with tiny mass
    (~1e-8 at vocab 49k) keep their share instead of vanishing in float32
    rounding, and a uniform just below 1 stays below 1.
    """
    if probs.device.type == "mps":  # no float64 on Apple GPUs
        cdf = torch.cumsum(probs.float(), dim=-1)
        u = uniforms.to(cdf.device, torch.float32)
    else:
        cdf = torch.cumsum(probs.double(), dim=-1)
        u = uniforms.to(cdf.device, torch.float64)
    total = cdf[..., -1:].contiguous()  # [n, 1]
    idx = torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True)
    # Rounding can put u * total at the very top of the CDF (idx == vocab):
    # then take the first index where the CDF reaches its total, which is the
    # last token whose mass registered in the CDF (never a zero-mass token).
    top = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(idx, top).squeeze(-1)

"""The playground's sampling panel: many first tokens drawn through rejection sampling, against p.

Given the target's next-token distribution p and the draft's q after one prompt (one
Predict call: one target pass, one draft call), each draw b is one speculative round of
k = 1 at its own coordinates of the counter-based RNG (seed, position b): the draft
token d ~ q, accepted with probability min(1, p(d) / q(d)), else the recovered token from
norm(max(0, p - q)). The exact draws go through specdec.core.verify, the orchestrator's
own verifier, so their frequencies must match p: a chi-square test over the most likely
tokens says how well.

The control is a deliberately wrong sampler with a classic bug: after a rejection it draws
from p instead of the residual. Its first-token distribution is min(p, q) + (1 - sum
min(p, q)) p, not p, and the same test must reject it. It lives here, in the page's
backend, and nowhere near the serving path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.core import rng
from specdec.core.rng import Purpose
from specdec.core.sampling import sample
from specdec.core.verify import count_accepted, verify_sampled_batch

EXACT, WRONG = "exact", "wrong"
SAMPLERS = (EXACT, WRONG)
MIN_EXPECTED = 5.0  # a chi-square bin needs at least this many expected draws
_CHUNK = 512  # draws verified per batch ([chunk, support] rows in memory)


@dataclass(frozen=True)
class Bin:
    ids: tuple[int, ...]  # one token, or several merged ("other")
    p: float  # target probability of the bin
    count: int  # draws that landed in it


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float


def draw_first_tokens(p: torch.Tensor, q: torch.Tensor, draws: int, seed: int,
                      sampler: str = EXACT) -> torch.Tensor:  # [draws] int64
    """The first committed token of `draws` independent rounds of k = 1 (see the module doc)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    p, q = p.float().reshape(-1), q.float().reshape(-1)
    # Only tokens that p or q can give matter: the samplers never return a token of
    # probability 0, so drawing over that support and mapping back is the same draw, and
    # after top-k truncation it is a few dozen tokens instead of the whole vocabulary.
    support = torch.nonzero((p > 0) | (q > 0)).reshape(-1)
    return support[_draw(p[support], q[support], draws, seed, sampler)]


def _draw(p: torch.Tensor, q: torch.Tensor, draws: int, seed: int, sampler: str) -> torch.Tensor:
    out = []
    for start in range(0, draws, _CHUNK):
        positions = np.arange(start, min(start + _CHUNK, draws), dtype=np.int64)
        n = len(positions)
        u_draft = torch.from_numpy(rng.uniforms(seed, positions, Purpose.DRAFT))
        drafted = sample(q.expand(n, -1), u_draft)  # [n]: d ~ q
        if sampler == EXACT:
            # Row 1 (after d) only feeds the bonus token, which is not counted.
            pp = torch.stack([p, p])
            verdicts = verify_sampled_batch([[int(d)] for d in drafted], [q[None]] * n, [pp] * n,
                                            seeds=[seed] * n, positions=positions.tolist())
            out.append(torch.tensor([v.tokens[0] for v in verdicts]))
        else:
            out.append(_wrong_first_tokens(p, q, drafted, seed, positions))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def _wrong_first_tokens(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, seed: int,
                        positions: np.ndarray) -> torch.Tensor:
    """The control: the same accept test, but a rejection redraws from p (not the residual)."""
    n = len(drafted)
    u_accept = torch.from_numpy(rng.uniforms(seed, positions, Purpose.ACCEPT)).reshape(n, 1)
    accepted = count_accepted(p[drafted].reshape(n, 1), q[drafted].reshape(n, 1),
                              torch.ones(n, dtype=torch.int64), u_accept)
    u_resample = torch.from_numpy(rng.uniforms(seed, positions, Purpose.RESAMPLE))
    redrawn = sample(p.expand(n, -1), u_resample)  # the bug: p, not norm(max(0, p - q))
    return torch.where(accepted.bool(), drafted, redrawn)


def bins_of(p: torch.Tensor, tokens: torch.Tensor, top: int = 10) -> list[Bin]:
    """The `top` most likely tokens under p, each a bin with >= MIN_EXPECTED expected draws,
    then one bin for every other token (merged into the last named bin if it is too small)."""
    p = p.double().reshape(-1)
    draws = len(tokens)
    counts = torch.bincount(tokens, minlength=p.shape[0])
    order = torch.argsort(p, descending=True).tolist()
    named = []
    for token in order[:top]:
        if p[token] * draws < MIN_EXPECTED:
            break
        named.append(token)
    bins = [Bin((t,), float(p[t]), int(counts[t])) for t in named]
    rest = order[len(named):]
    rest_p = float(p[rest].sum()) if rest else 0.0
    rest_count = int(counts[rest].sum()) if rest else 0
    if rest and (rest_p * draws >= MIN_EXPECTED or not bins):
        bins.append(Bin(tuple(rest), rest_p, rest_count))
    elif rest:
        last = bins.pop()
        bins.append(Bin(last.ids + tuple(rest), last.p + rest_p, last.count + rest_count))
    return bins


def chi_square(bins: list[Bin], draws: int) -> ChiSquare:
    """Pearson's chi-square of the bins' counts against draws * p, and its p-value."""
    if len(bins) < 2:
        return ChiSquare(0.0, 0, 1.0)
    expected = np.array([b.p for b in bins]) * draws
    observed = np.array([b.count for b in bins], dtype=np.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(bins) - 1
    # The chi-square survival function is the regularised upper incomplete gamma Q(dof/2, x/2).
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return ChiSquare(statistic, dof, p_value)

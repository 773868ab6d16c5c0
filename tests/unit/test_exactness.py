"""Statistical exactness of rejection sampling: the output has the target's distribution.

Each (target, draft) pair is a first-order Markov "model" (a table of next-token
distributions indexed by the previous token). 100,000 independent trials, each
with its own seed, run whole speculative rounds (k = 4 drafted tokens, drafted
with the counter-based DRAFT uniforms, verified with the ACCEPT / RESAMPLE
uniforms at their absolute positions) until two tokens are committed. The first
token's distribution and the joint distribution of the first two tokens are
compared with the target chain by a chi-square test (p-value threshold
tests.chance.FALSE_ALARM = 1e-6). A wrong sampler — replacement drawn from p
instead of the residual norm(max(0, p - q)) — must fail the very same test,
which shows the test has the power to catch the classic bug.

Chance: the seeds are fixed (1,000,000 + trial), so given the code the outcome is
deterministic and a rerun cannot flip it. With fresh seeds a correct sampler would
fail each of the 8 checks (4 pairs x first token and joint) with probability 1e-6:
below 1e-5 for the file. The wrong sampler's statistics are 2,296 to 19,364 against
critical values of 33 to 131: it fails at any seed.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core import rng
from specdec.core.rng import Purpose
from specdec.core.sampling import SamplingParams, probs_from_logits, sample
from specdec.core.verify import count_accepted, draw_extra, verify_sampled
from tests.chance import FALSE_ALARM

torch.set_num_threads(1)

VOCAB = 8
TRIALS = 100_000
K = 4
P_THRESHOLD = FALSE_ALARM  # per check, for a fresh seed (the seeds here are fixed)
START = VOCAB  # row index of the "previous token" before the first position

Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _table(gen: torch.Generator, scale: float) -> torch.Tensor:
    return torch.randn(VOCAB + 1, VOCAB, generator=gen) * scale  # [vocab + 1, vocab] logits


def make_pair(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_table, q_table), each [vocab + 1, vocab]: next-token distributions per previous token."""
    gen = torch.Generator().manual_seed({"close": 1, "far": 2, "disjoint": 3, "truncated": 4}[kind])
    target = _table(gen, 1.0)
    if kind == "close":
        draft = target + 0.3 * torch.randn(target.shape, generator=gen)
        return torch.softmax(target, -1), torch.softmax(draft, -1)
    if kind == "far":
        return torch.softmax(target, -1), torch.softmax(_table(gen, 1.5), -1)
    if kind == "disjoint":
        # The target only ever emits even tokens, the draft only odd ones: every
        # drafted token is rejected and every output token is recovered.
        even = torch.arange(VOCAB) % 2 == 0
        p = torch.softmax(target.masked_fill(~even, float("-inf")), -1)
        q = torch.softmax(_table(gen, 1.0).masked_fill(even, float("-inf")), -1)
        return p, q
    if kind == "truncated":
        # The distributions the samplers really use: top-k / top-p / temperature.
        p = probs_from_logits(target, SamplingParams(temperature=0.8, top_k=6, top_p=0.9))
        draft = target + 0.8 * torch.randn(target.shape, generator=gen)
        q = probs_from_logits(draft, SamplingParams(temperature=1.2, top_k=5, top_p=0.95))
        return p, q
    raise ValueError(kind)


def batched_sampler(
    drafted: torch.Tensor,  # [batch, k_max] int64, entries beyond num_drafted ignored
    num_drafted: torch.Tensor,  # [batch] int64, each in 0..k_max
    draft_probs: torch.Tensor | None,  # [batch, k_max, vocab] q; None = one-hot proposals
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab] p
    accept_uniforms: torch.Tensor,  # [batch, k_max] the accept test's uniform per drafted token
    resample_uniforms: torch.Tensor,  # [batch, k_max + 1] the extra token's uniform per offset
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], extra token [batch]
    """Batched rejection sampling (Leviathan et al. 2023, Algorithm 1) from the core's kernels.

    The simulation below runs 100,000 sessions at once through this; a test
    checks it decides exactly as the public verify_sampled.

    For each row b, with m = the number of leading drafted tokens d_i
    (i < num_drafted[b]) that pass r_i < min(1, p_i(d_i) / q_i(d_i)), the extra
    token is drawn by inverse CDF with resample_uniforms[b, m] from
      norm(max(0, p_m - q_m))   if m < num_drafted[b]   (recovered)
      p_m                       if m == num_drafted[b]  (bonus)
    Works on any device; the whole batch is a handful of kernels.
    """
    batch, k_max = drafted.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    drafted = drafted.to(device=device, dtype=torch.int64)
    num_drafted = num_drafted.to(device=device, dtype=torch.int64)
    index = drafted.unsqueeze(-1)  # [batch, k_max, 1]
    p_d = target_probs[:, :k_max].gather(-1, index).squeeze(-1)  # [batch, k_max]
    q_d = None if draft_probs is None else draft_probs.gather(-1, index).squeeze(-1)
    accepted = count_accepted(p_d, q_d, num_drafted, accept_uniforms)
    at = accepted.clamp(max=max(k_max - 1, 0))
    q_row = None if draft_probs is None or k_max == 0 else draft_probs[rows, at]
    d_m = drafted[rows, at] if k_max else torch.zeros_like(accepted)
    u = resample_uniforms.to(device=device, dtype=torch.float64)[rows, accepted]
    extra = draw_extra(target_probs[rows, accepted], q_row, d_m, accepted < num_drafted, u)
    return accepted, extra


def wrong_sampler(drafted, num_drafted, draft_probs, target_probs, accept_u, resample_u):
    """The classic bug: same accept test, but the replacement is drawn from p, not the residual."""
    accepted, _ = batched_sampler(drafted, num_drafted, draft_probs, target_probs, accept_u, resample_u)
    rows = torch.arange(drafted.shape[0])
    return accepted, sample(target_probs[rows, accepted], resample_u[rows, accepted])


def simulate(
    p_table: torch.Tensor, q_table: torch.Tensor, *, length: int, sampler: Sampler, seed_base: int
) -> np.ndarray:  # [TRIALS, length] committed tokens
    """Run speculative rounds for TRIALS independent sessions until `length` tokens each."""
    out = np.full((TRIALS, length), -1, dtype=np.int64)
    n = np.zeros(TRIALS, dtype=np.int64)
    seeds = np.arange(TRIALS, dtype=np.int64) + seed_base
    arange_k = np.arange(K + 1)
    while (n < length).any():
        act = np.nonzero(n < length)[0]
        pos = n[act]
        prev = np.where(pos > 0, out[act, np.maximum(pos - 1, 0)], START)
        s = seeds[act]
        # 1. draft K tokens autoregressively from the draft chain.
        ctx = torch.from_numpy(prev)
        drafted, q_rows, p_rows = [], [], [p_table[ctx]]
        for i in range(K):
            q = q_table[ctx]  # [active, vocab]
            d = sample(q, torch.from_numpy(rng.uniforms(s, pos + i, Purpose.DRAFT)))
            drafted.append(d)
            q_rows.append(q)
            p_rows.append(p_table[d])
            ctx = d
        drafted_t = torch.stack(drafted, 1)  # [active, K]
        # 2.-3. the target's rows for every drafted prefix; verify.
        accept_u = torch.from_numpy(rng.uniforms(s[:, None], pos[:, None] + arange_k[None, :K], Purpose.ACCEPT))
        resample_u = torch.from_numpy(rng.uniforms(s[:, None], pos[:, None] + arange_k[None, :], Purpose.RESAMPLE))
        accepted, extra = sampler(
            drafted_t, torch.full((len(act),), K), torch.stack(q_rows, 1), torch.stack(p_rows, 1), accept_u, resample_u
        )
        # 4. commit accepted drafted tokens then the extra one, up to `length`.
        m = accepted.numpy()
        for j in range(K + 1):
            tok = np.where(j < m, drafted_t[:, min(j, K - 1)].numpy(), extra.numpy())
            write = (j <= m) & (pos + j < length)
            out[act[write], pos[write] + j] = tok[write]
        n[act] = np.minimum(pos + m + 1, length)
    return out


def chi_square(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """p-value of observed counts against probabilities; zero-probability cells must be empty.

    Cells with expected count < 5 are pooled into one bin (the usual validity rule).
    """
    observed = observed.ravel().astype(np.float64)
    expected = expected_p.ravel() / expected_p.sum() * observed.sum()  # float32 tables sum to 1 +- 1e-7
    zero = expected_p.ravel() == 0
    assert observed[zero].sum() == 0, "a token the target gives probability 0 was emitted"
    big = expected >= 5
    obs = list(observed[big & ~zero])
    exp = list(expected[big & ~zero])
    small = ~big & ~zero
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    return float(chisquare(obs, exp).pvalue)


def first_two_pvalues(p_table: torch.Tensor, tokens: np.ndarray) -> tuple[float, float]:
    p = p_table.double().numpy()
    first = np.bincount(tokens[:, 0], minlength=VOCAB)
    joint = np.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    chain = p[START][:, None] * p[:VOCAB]  # P(x1, x2) = p(x1 | start) p(x2 | x1)
    return chi_square(first, p[START]), chi_square(joint, chain)


PAIRS = ["close", "far", "disjoint", "truncated"]
PVALUES: dict[str, tuple[float, float]] = {}


@pytest.mark.parametrize("kind", PAIRS)
def test_output_distribution_equals_target(kind: str) -> None:
    p_table, q_table = make_pair(kind)
    tokens = simulate(p_table, q_table, length=2, sampler=batched_sampler, seed_base=1_000_000)
    p_first, p_joint = first_two_pvalues(p_table, tokens)
    PVALUES[kind] = (p_first, p_joint)
    print(f"\nexactness {kind}: first-token p={p_first:.4f}, two-token joint p={p_joint:.4f}")
    assert p_first > P_THRESHOLD, f"{kind}: first-token distribution differs from the target (p={p_first:.2e})"
    assert p_joint > P_THRESHOLD, f"{kind}: two-token joint differs from the target chain (p={p_joint:.2e})"


@pytest.mark.parametrize("kind", ["close", "far", "truncated"])
def test_wrong_sampler_fails_the_same_test(kind: str) -> None:
    # (For disjoint supports the residual IS p, so the wrong sampler is right there.)
    p_table, q_table = make_pair(kind)
    tokens = simulate(p_table, q_table, length=2, sampler=wrong_sampler, seed_base=1_000_000)
    p_first, p_joint = first_two_pvalues(p_table, tokens)
    print(f"\nwrong sampler {kind}: first-token p={p_first:.2e}, two-token joint p={p_joint:.2e}")
    assert min(p_first, p_joint) < P_THRESHOLD


def test_truncated_pair_really_truncates() -> None:
    # Guard against the truncated pair silently degenerating into an untruncated one.
    p_table, q_table = make_pair("truncated")
    assert ((p_table == 0).sum(-1) >= 2).all()
    assert ((q_table == 0).sum(-1) >= 3).all()
    assert ((p_table > 0) != (q_table > 0)).any()


def test_simulation_uses_the_public_verifier() -> None:
    """The kernel driven above makes the same decisions as verify_sampled with the same seed."""
    p_table, q_table = make_pair("far")
    for trial in range(200):
        seed, position = 77 + trial, trial % 5
        prev, drafted, q_rows, p_rows = START, [], [], [p_table[START]]
        for i in range(K):
            q = q_table[prev]
            d = int(sample(q[None], torch.tensor([rng.uniform(seed, position + i, Purpose.DRAFT)]))[0])
            drafted.append(d)
            q_rows.append(q)
            p_rows.append(p_table[d])
            prev = d
        q_t, p_t = torch.stack(q_rows), torch.stack(p_rows)
        verdict = verify_sampled(drafted, q_t, p_t, seed=seed, position=position)
        offs = np.arange(K + 1) + position
        accepted, extra = batched_sampler(
            torch.tensor([drafted]), torch.tensor([K]), q_t[None], p_t[None],
            torch.from_numpy(rng.uniforms(seed, offs[:K], Purpose.ACCEPT))[None],
            torch.from_numpy(rng.uniforms(seed, offs, Purpose.RESAMPLE))[None],
        )
        assert verdict.accepted == int(accepted[0])
        assert verdict.tokens == drafted[: verdict.accepted] + [int(extra[0])]

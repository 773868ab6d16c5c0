"""Verification: which drafted tokens the target accepts, and the one extra token.

Vocabulary (as in vLLM): a round has k **drafted** tokens d_1..d_k; the target
**accepts** a prefix d_1..d_m of them; then exactly one more token is produced:
the **recovered** token (drawn from the residual distribution after the first
rejection, m < k) or the **bonus** token (drawn from the target's distribution
after the last drafted token, m == k). Every round therefore commits m + 1 >= 1
tokens, so speculation never needs more target passes than plain decoding.

Greedy verification compares token ids; sampled verification is the rejection
sampler of Leviathan et al. 2023 ("Fast Inference from Transformers via
Speculative Decoding", Algorithm 1), whose output has exactly the target's
distribution whatever the draft. A deterministic proposer (prompt lookup, a user
guess) is verified by the same sampler with a one-hot q.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core import rng
from specdec.core.rng import Purpose
from specdec.core.sampling import sample

RECOVERED = "recovered"
BONUS = "bonus"


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one round of drafted tokens."""

    accepted: int  # m: how many drafted tokens were accepted (a prefix)
    tokens: list[int]  # the m accepted drafted tokens, then the extra token
    extra_kind: str  # RECOVERED (after a rejection) or BONUS (all accepted)

    @property
    def accepted_tokens(self) -> list[int]:
        return self.tokens[: self.accepted]

    @property
    def extra_token(self) -> int:
        return self.tokens[-1]

    @property
    def all_accepted(self) -> bool:
        return self.extra_kind == BONUS


def verify_greedy(
    drafted: Sequence[int],  # [k]
    target_argmax: Sequence[int],  # [k + 1]: the target's argmax after each prefix
) -> Verdict:
    """Greedy verification: accept while the drafted token equals the target argmax.

    target_argmax[i] is the target's choice for the token at the position of
    drafted[i] (and target_argmax[k] for the one after the last drafted token).
    The extra token is the target's argmax at the first mismatch (recovered) or
    after the last drafted token (bonus), so the result is exactly the target's
    own greedy continuation.
    """
    k = len(drafted)
    if len(target_argmax) != k + 1:
        raise ValueError(f"target_argmax must have len(drafted) + 1 = {k + 1} entries, got {len(target_argmax)}")
    m = 0
    while m < k and int(drafted[m]) == int(target_argmax[m]):
        m += 1
    tokens = [int(t) for t in drafted[:m]]
    tokens.append(int(target_argmax[m]))
    return Verdict(accepted=m, tokens=tokens, extra_kind=BONUS if m == k else RECOVERED)


def rejection_sample(
    drafted: torch.Tensor,  # [batch, k_max] int64, entries beyond num_drafted ignored
    num_drafted: torch.Tensor,  # [batch] int64, each in 0..k_max
    draft_probs: torch.Tensor | None,  # [batch, k_max, vocab] q; None = one-hot proposals
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab] p
    accept_uniforms: torch.Tensor,  # [batch, k_max] the accept test's uniform per drafted token
    resample_uniforms: torch.Tensor,  # [batch, k_max + 1] the extra token's uniform per offset
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], extra token [batch]
    """Batched rejection sampling (Leviathan et al. 2023, Algorithm 1), tensors in, tensors out.

    For each row b and drafted token i < num_drafted[b] (names as in the paper):
      accept d_i  iff  r_i < min(1, p_i(d_i) / q_i(d_i)),  tested as r_i * q_i(d_i) < p_i(d_i)
    (so a drafted token with q_i(d_i) == 0 or p_i(d_i) == 0 is always rejected).
    With m = the number of leading accepted tokens, the extra token is drawn by
    inverse CDF with resample_uniforms[b, m] from
      norm(max(0, p_m - q_m))   if m < num_drafted[b]   (recovered)
      p_m                       if m == num_drafted[b]  (bonus)
    If the residual has no mass (p_m == q_m up to rounding, where a rejection has
    probability ~0) the draw falls back to p_m. Works on any device; the whole
    batch costs a handful of kernels regardless of batch size.
    """
    batch, k_max = drafted.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    drafted = drafted.to(device=device, dtype=torch.int64)
    num_drafted = num_drafted.to(device=device, dtype=torch.int64)

    if k_max > 0:
        p_d = target_probs[:, :k_max].gather(-1, drafted.unsqueeze(-1)).squeeze(-1)  # [batch, k_max]
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
        else:
            q_d = draft_probs.gather(-1, drafted.unsqueeze(-1)).squeeze(-1)  # [batch, k_max]
        # Float64 so a uniform just below 1 is not rounded up to 1 (which would
        # reject a token with p == q).
        u = accept_uniforms.to(device=device, dtype=torch.float64)
        ok = (u * q_d.double() < p_d.double()) & (q_d > 0)
        in_draft = torch.arange(k_max, device=device) < num_drafted.unsqueeze(-1)
        accepted = torch.cumprod((ok & in_draft).to(torch.int64), dim=-1).sum(dim=-1)  # [batch]
    else:
        accepted = torch.zeros(batch, dtype=torch.int64, device=device)

    p_row = target_probs[rows, accepted].float()  # [batch, vocab]
    rejected = accepted < num_drafted  # [batch]
    if k_max > 0 and bool(rejected.any()):
        at = accepted.clamp(max=k_max - 1)
        if draft_probs is None:
            # max(0, p - onehot(d)) is p with the rejected token zeroed.
            residual = p_row.clone()
            d = drafted[rows, at]
            residual[rows, d] = torch.where(rejected, 0.0, residual[rows, d])
        else:
            q_row = draft_probs[rows, at].float() * rejected.unsqueeze(-1)
            residual = (p_row - q_row).clamp_(min=0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_row, residual)
    else:
        residual = p_row
    u_extra = resample_uniforms.to(device=device, dtype=torch.float64)[rows, accepted]
    extra = sample(residual, u_extra)
    return accepted, extra


def _check_shapes(k: int, draft_probs: torch.Tensor | None, target_probs: torch.Tensor) -> None:
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs must be [len(drafted) + 1, vocab] = [{k + 1}, vocab], got {list(target_probs.shape)}"
        )
    if draft_probs is not None and (draft_probs.dim() != 2 or tuple(draft_probs.shape) != (k, target_probs.shape[1])):
        raise ValueError(
            f"draft_probs must be [len(drafted), vocab] = [{k}, {target_probs.shape[1]}], got {list(draft_probs.shape)}"
        )


def _check_tokens(drafted: Sequence[int], vocab: int) -> None:
    for t in drafted:
        if not 0 <= int(t) < vocab:
            raise ValueError(f"drafted token {int(t)} is outside the vocabulary [0, {vocab})")


def verify_sampled(
    drafted: Sequence[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab] q, or None for a deterministic proposer
    target_probs: torch.Tensor,  # [k + 1, vocab] p
    *,
    seed: int,
    position: int,
) -> Verdict:
    """Exact speculative sampling for one session (Leviathan et al. 2023, Algorithm 1).

    `position` is the absolute position of drafted[0] (tokens before it in the
    sequence). The accept test of drafted[i] uses rng.uniform(seed, position + i,
    ACCEPT); the recovered or bonus token at absolute position j uses
    rng.uniform(seed, j, RESAMPLE). So a retried round draws the same numbers and
    makes the same decisions. With k == 0 this is ordinary sampling from
    target_probs[0]. p and q must be the distributions the samplers actually use
    (temperature, top-k, top-p applied); greedy rows are one-hot, for which this
    reduces to greedy verification.
    """
    k = len(drafted)
    _check_shapes(k, draft_probs, target_probs)
    _check_tokens(drafted, target_probs.shape[1])
    verdicts = _verify_packed(
        [list(drafted)], None if draft_probs is None else draft_probs.unsqueeze(0),
        target_probs.unsqueeze(0), seeds=[seed], positions=[position]
    )
    return verdicts[0]


def verify_sampled_batch(
    drafted: Sequence[Sequence[int]],  # batch of [k_b]
    draft_probs: Sequence[torch.Tensor | None],  # batch of [k_b, vocab] or None
    target_probs: Sequence[torch.Tensor],  # batch of [k_b + 1, vocab]
    *,
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[Verdict]:
    """verify_sampled for several sessions (each with its own k, seed, position) in one call.

    Element b equals verify_sampled(drafted[b], draft_probs[b], target_probs[b],
    seed=seeds[b], position=positions[b]); the work is done as one padded batch.
    """
    n = len(drafted)
    if not (len(draft_probs) == len(target_probs) == len(seeds) == len(positions) == n):
        raise ValueError("drafted, draft_probs, target_probs, seeds and positions must have one entry per session")
    if n == 0:
        return []
    vocab = target_probs[0].shape[-1]
    for d, q, p in zip(drafted, draft_probs, target_probs):
        _check_shapes(len(d), q, p)
        if p.shape[1] != vocab:
            raise ValueError(f"target_probs vocab sizes differ: {p.shape[1]} vs {vocab}")
        _check_tokens(d, vocab)
    k_max = max(len(d) for d in drafted)
    device = target_probs[0].device
    p_pad = torch.zeros(n, k_max + 1, vocab, device=device)
    q_pad = torch.zeros(n, k_max, vocab, device=device) if any(q is not None for q in draft_probs) else None
    for b, (d, q, p) in enumerate(zip(drafted, draft_probs, target_probs)):
        p_pad[b, : len(d) + 1] = p
        if q_pad is not None:
            if q is not None:
                q_pad[b, : len(d)] = q
            elif d:
                q_pad[b, torch.arange(len(d)), torch.tensor(d)] = 1.0
    return _verify_packed(
        [list(d) for d in drafted], q_pad, p_pad, seeds=list(seeds), positions=list(positions)
    )


def _verify_packed(
    drafted: list[list[int]],
    draft_probs: torch.Tensor | None,  # [batch, k_max, vocab]
    target_probs: torch.Tensor,  # [batch, k_max + 1, vocab]
    *,
    seeds: list[int],
    positions: list[int],
) -> list[Verdict]:
    """Draw the counter-based uniforms, run rejection_sample, build Verdicts."""
    batch = len(drafted)
    k_max = target_probs.shape[1] - 1
    offsets = torch.arange(k_max + 1).numpy()
    seed_col = rng._as_u64(seeds).reshape(batch, 1)
    pos = rng._as_u64(positions).reshape(batch, 1) + offsets.astype("uint64")  # [batch, k_max + 1]
    accept_u = torch.from_numpy(rng.uniforms(seed_col, pos[:, :k_max], Purpose.ACCEPT))
    resample_u = torch.from_numpy(rng.uniforms(seed_col, pos, Purpose.RESAMPLE))
    padded = torch.zeros(batch, k_max, dtype=torch.int64)
    for b, d in enumerate(drafted):
        padded[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
    lengths = torch.tensor([len(d) for d in drafted], dtype=torch.int64)
    accepted, extra = rejection_sample(
        padded, lengths, draft_probs, target_probs, accept_u, resample_u
    )
    accepted_l = accepted.tolist()
    extra_l = extra.tolist()
    out = []
    for b, d in enumerate(drafted):
        m = accepted_l[b]
        out.append(Verdict(accepted=m, tokens=d[:m] + [extra_l[b]], extra_kind=BONUS if m == len(d) else RECOVERED))
    return out

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
distribution whatever the draft. A deterministic proposal (prompt lookup, a user
guess, a prediction: q one-hot) is verified by coupling instead: the target's
own token at every position is drawn with the very uniform target-only decoding
would use there, and a drafted token is accepted iff it equals that draw. Each
committed token is then exactly the token target-only sampling commits, so the
text is the same as without the proposal (not only its distribution), at the
same acceptance rate (P(draw = d) = p(d), as Algorithm 1's test gives for a
one-hot q).

A seeded request uses the coupled sampler (specdec.core.sampling.coupled_draws)
for every proposer, the draft model included: the target draws each position
with Gumbel noise fixed by (seed, position), the draft drafts with the same
noise, and a drafted token is accepted iff it equals the target's draw
(`verify_coupled`). The committed tokens are then the target-only sample for
that seed whatever was drafted, by whom, at which k, in which batch: one seed,
one text. Its acceptance is that of the shared-noise coupling, below Algorithm
1's optimum (see docs/api.md for the measured cost).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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


def verify_coupled(
    drafted: Sequence[int],  # [k]
    target_draws: Sequence[int],  # [k + 1]: the target's coupled draw after each prefix
) -> Verdict:
    """Coupled sampling: accept while the drafted token equals the target's own draw there.

    target_draws[i] is the token target-only decoding with this seed draws at
    the position of drafted[i] (given the accepted prefix before it), so the
    committed tokens are exactly target-only decoding's; the extra token is the
    target's draw at the first mismatch (recovered) or after the last drafted
    token (bonus). The same rule as greedy verification, on draws instead of argmaxes.
    """
    return verify_greedy(drafted, target_draws)


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A tree round's verdict: `accepted` is the depth of the accepted path (Verdict.tokens: its
    tokens, then the extra token)."""

    path: tuple[int, ...] = ()  # the accepted drafted tokens' indices, from depth 1 down
    ranks: tuple[int, ...] = ()  # each one's rank among its siblings (0 = its parent's first child)


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each node's children in order (-1: the last committed token's), the parents checked."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent} is not an earlier node or -1")
        children.setdefault(parent, []).append(i)
    return children


def node_depths(parents: Sequence[int]) -> list[int]:
    """Each tree node's depth (1: a child of the last committed token; parents come first)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def verify_tree(
    drafted: Sequence[int],  # [n] the tree's tokens, parents first
    parents: Sequence[int],  # [n] each one's parent: an earlier index, or -1 (the last committed token)
    target: Sequence[int],  # [n + 1] the target's token after the committed tokens, then after each node
) -> TreeVerdict:
    """Token trees: from the committed tokens, follow the child equal to the target's token there.

    target[0] is the target's own token after the committed tokens (argmax, or its
    coupled draw); target[i + 1] is its token after drafted[i] on that node's path.
    Each step takes the child (first among equal siblings) whose token is the target's
    own there; the extra token is the target's token after the last accepted node. The
    committed tokens are therefore exactly target-only decoding's: greedy, or coupled
    sampling (whose draw at a position depends only on the path before it), whatever
    the tree. Without a coupling, sampled trees go through verify_tree_sampled.
    """
    n = len(drafted)
    if len(parents) != n or len(target) != n + 1:
        raise ValueError(f"parents and target must have {n} and {n + 1} entries, got {len(parents)} and {len(target)}")
    children = _children(parents)
    node, path, ranks = -1, [], []
    while True:
        want = int(target[node + 1])
        kids = children.get(node, [])
        match = next((r for r, child in enumerate(kids) if int(drafted[child]) == want), None)
        if match is None:
            break
        node = kids[match]
        path.append(node)
        ranks.append(match)
    tokens = [int(drafted[i]) for i in path] + [int(target[node + 1])]
    return TreeVerdict(accepted=len(path), tokens=tokens, extra_kind=RECOVERED if children.get(node) else BONUS,
                       path=tuple(path), ranks=tuple(ranks))


def verify_tree_sampled(
    drafted: Sequence[int],  # [n] the tree's tokens, parents first
    parents: Sequence[int],  # [n] each one's parent: an earlier index, or -1
    target_probs: torch.Tensor,  # [n + 1, vocab] p after the committed tokens, then after each node
    *,
    seed: int,
    position: int,  # absolute position of a depth-1 node
) -> TreeVerdict:
    """Token trees for sampling without a coupling: recursive rejection over siblings.

    From the committed tokens, the children of the current node are tried in order, each as a
    one-hot proposal against the residual r (p there, less the siblings already rejected):
    child c is accepted with probability r(c) / sum(r), else r(c) = 0 and the next is tried.
    The first accepted child becomes the current node; if none is, the token is drawn from the
    residual (recovered), and at a leaf from p (bonus). Sequential one-hot tests give each
    sibling c_j exactly p(c_j) and every other token its p, whatever the siblings are, so the
    output has the target's distribution for any tree made without the target's randomness.
    Sibling j's test at absolute position P uses rng.uniform(seed, P, ACCEPT, j), the drawn
    token rng.uniform(seed, P, RESAMPLE): a retried round decides the same.
    """
    n = len(drafted)
    if len(parents) != n or target_probs.shape[0] != n + 1:
        raise ValueError(f"parents and target_probs must have {n} and {n + 1} rows, "
                         f"got {len(parents)} and {target_probs.shape[0]}")
    _check_tokens(drafted, target_probs.shape[1])
    children = _children(parents)
    node, path, ranks = -1, [], []
    while True:
        at = position + len(path)
        residual = target_probs[node + 1].double().clone()
        accepted = None
        for rank, child in enumerate(children.get(node, [])):
            token, total = int(drafted[child]), float(residual.sum())
            if total > 0 and rng.uniform(seed, at, Purpose.ACCEPT, rank) * total < float(residual[token]):
                accepted = (rank, child)
                break
            residual[token] = 0.0
        if accepted is None:
            break
        ranks.append(accepted[0])
        node = accepted[1]
        path.append(node)
    u = torch.tensor([rng.uniform(seed, at, Purpose.RESAMPLE)], dtype=torch.float64)
    extra = int(sample(residual[None], u)[0])
    return TreeVerdict(accepted=len(path), tokens=[int(drafted[i]) for i in path] + [extra],
                       extra_kind=RECOVERED if children.get(node) else BONUS, path=tuple(path), ranks=tuple(ranks))


def count_accepted(
    p_drafted: torch.Tensor,  # [batch, k_max] p_i(d_i): target probability of each drafted token
    q_drafted: torch.Tensor | None,  # [batch, k_max] q_i(d_i); None = one-hot proposals (q = 1)
    num_drafted: torch.Tensor,  # [batch] int64, each in 0..k_max
    accept_uniforms: torch.Tensor,  # [batch, k_max]
) -> torch.Tensor:  # [batch] int64: m, the accepted prefix length
    """The accept tests of Algorithm 1: accept d_i iff r_i < min(1, p_i(d_i) / q_i(d_i)).

    Tested as r_i * q_i(d_i) < p_i(d_i) in float64 (a uniform just below 1 must
    not round up to 1 and reject a token with p == q), so a drafted token with
    q_i(d_i) == 0 or p_i(d_i) == 0 is always rejected.
    """
    batch, k_max = p_drafted.shape
    device = p_drafted.device
    if k_max == 0:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    u = accept_uniforms.to(device=device, dtype=torch.float64)
    p_d = p_drafted.double()
    if q_drafted is None:
        ok = u < p_d
    else:
        q_d = q_drafted.to(device).double()
        ok = (u * q_d < p_d) & (q_d > 0)
    ok &= torch.arange(k_max, device=device) < num_drafted.to(device).unsqueeze(-1)
    return torch.cumprod(ok.to(torch.int64), dim=-1).sum(dim=-1)


def draw_extra(
    p_row: torch.Tensor,  # [batch, vocab] p_m: the target row after the accepted prefix
    q_row: torch.Tensor | None,  # [batch, vocab] q_m for rejected rows (ignored elsewhere); None = one-hot
    rejected_token: torch.Tensor,  # [batch] int64 d_m (used when q_row is None)
    rejected: torch.Tensor,  # [batch] bool: m < num_drafted (recovered) vs bonus
    uniforms: torch.Tensor,  # [batch] the RESAMPLE uniform at the extra token's position
) -> torch.Tensor:  # [batch] int64
    """The extra token: recovered from norm(max(0, p_m - q_m)) after a rejection, bonus from p_m.

    If a residual has no mass (p_m == q_m up to rounding, where a rejection has
    probability ~0) the draw falls back to p_m.
    """
    p_row = p_row.float()
    device = p_row.device
    if bool(rejected.any()):
        if q_row is None:
            # max(0, p - onehot(d)) is p with the rejected token zeroed.
            residual = p_row.clone()
            rows = torch.arange(p_row.shape[0], device=device)
            d = rejected_token.to(device)
            residual[rows, d] = residual[rows, d] * (~rejected.to(device))
        else:
            q = q_row.to(device).float() * rejected.to(device).unsqueeze(-1)
            residual = (p_row - q).clamp_(min=0.0)
        empty = (residual.sum(dim=-1, keepdim=True) <= 0).float()  # [batch, 1]
        residual.addcmul_(p_row, empty)
    else:
        residual = p_row
    return sample(residual, uniforms)


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
    verdicts = _verify_lists([[int(t) for t in drafted]], [draft_probs], [target_probs], [seed], [position])
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
    seed=seeds[b], position=positions[b]); the accept tests and the extra-token
    draws each run as one batched operation.
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
    return _verify_lists(list(map(list, drafted)), list(draft_probs), list(target_probs), list(seeds), list(positions))


def _uniform_tables(seeds: list[int], positions: list[int], k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ACCEPT uniforms [batch, k_max] and RESAMPLE uniforms [batch, k_max + 1] at absolute positions."""
    batch = len(seeds)
    seed_col = rng._as_u64(seeds).reshape(batch, 1)
    pos = rng._as_u64(positions).reshape(batch, 1) + np.arange(k_max + 1, dtype=np.uint64)  # [batch, k_max + 1]
    accept_u = torch.from_numpy(rng.uniforms(seed_col, pos[:, :k_max], Purpose.ACCEPT))
    resample_u = torch.from_numpy(rng.uniforms(seed_col, pos, Purpose.RESAMPLE))
    return accept_u, resample_u


def _verify_lists(
    drafted: list[list[int]],
    draft_probs: list[torch.Tensor | None],  # each [k_b, vocab] or None
    target_probs: list[torch.Tensor],  # each [k_b + 1, vocab]
    seeds: list[int],
    positions: list[int],
) -> list[Verdict]:
    """Sessions with a q by rejection sampling, deterministic proposals (q None) by coupling."""
    out: list[Verdict | None] = [None] * len(drafted)
    groups = ([b for b, q in enumerate(draft_probs) if q is None], _verify_coupled), \
             ([b for b, q in enumerate(draft_probs) if q is not None], _verify_rejection)
    for members, verify in groups:
        if members:
            verdicts = verify([drafted[b] for b in members], [draft_probs[b] for b in members],
                              [target_probs[b] for b in members], [seeds[b] for b in members],
                              [positions[b] for b in members])
            for b, verdict in zip(members, verdicts):
                out[b] = verdict
    return out  # type: ignore[return-value]


def _verify_coupled(
    drafted: list[list[int]],
    draft_probs: list[None],
    target_probs: list[torch.Tensor],  # each [k_b + 1, vocab]
    seeds: list[int],
    positions: list[int],
) -> list[Verdict]:
    """Deterministic proposals: draw x_j ~ p_j with the RESAMPLE uniform at j, accept d_j iff x_j == d_j.

    The first x_j that differs is the recovered token (it is never d_j), and
    x_k is the bonus; one inverse-CDF call draws every row of every session.
    """
    k_max = max(len(d) for d in drafted)
    _, resample_u = _uniform_tables(seeds, positions, k_max)
    rows = torch.cat([p[: len(d) + 1] for d, p in zip(drafted, target_probs)])
    u = torch.cat([resample_u[b, : len(d) + 1] for b, d in enumerate(drafted)])
    draws = sample(rows, u).tolist()
    verdicts, at = [], 0
    for d in drafted:
        x = draws[at:at + len(d) + 1]
        at += len(d) + 1
        m = 0
        while m < len(d) and x[m] == d[m]:
            m += 1
        verdicts.append(Verdict(accepted=m, tokens=list(d[:m]) + [x[m]],
                                extra_kind=RECOVERED if m < len(d) else BONUS))
    return verdicts


def _verify_rejection(
    drafted: list[list[int]],
    draft_probs: list[torch.Tensor],  # each [k_b, vocab]
    target_probs: list[torch.Tensor],  # each [k_b + 1, vocab]
    seeds: list[int],
    positions: list[int],
) -> list[Verdict]:
    """Batch verification without copying whole distributions into a padded tensor.

    Only the k_b probabilities at the drafted tokens and ONE row per session
    (p_m, q_m) are gathered; the accept tests and the extra draws each run as
    one batched operation.
    """
    batch = len(drafted)
    k_max = max(len(d) for d in drafted)
    device = target_probs[0].device
    accept_u, resample_u = _uniform_tables(seeds, positions, k_max)
    lengths = [len(d) for d in drafted]
    p_d = torch.zeros(batch, k_max, device=device)
    q_d = torch.ones(batch, k_max, device=device)
    d_t = [torch.tensor(d, dtype=torch.int64, device=device) for d in drafted]
    for b, (d, q, p) in enumerate(zip(d_t, draft_probs, target_probs)):
        if lengths[b]:
            ar = torch.arange(lengths[b], device=device)
            p_d[b, : lengths[b]] = p[ar, d]
            if q is not None:
                q_d[b, : lengths[b]] = q[ar, d]
    num = torch.tensor(lengths, dtype=torch.int64)
    accepted = count_accepted(p_d, q_d, num, accept_u).tolist()
    rejected = [m < n for m, n in zip(accepted, lengths)]
    p_row = torch.stack([p[m] for p, m in zip(target_probs, accepted)])  # [batch, vocab]
    q_row = None
    if any(r and q is not None for r, q in zip(rejected, draft_probs)):
        q_row = torch.zeros_like(p_row)
        for b, (q, m) in enumerate(zip(draft_probs, accepted)):
            if rejected[b]:
                if q is not None:
                    q_row[b] = q[m]
                else:
                    q_row[b, drafted[b][m]] = 1.0
    d_m = torch.tensor([d[m] if r else 0 for d, m, r in zip(drafted, accepted, rejected)], dtype=torch.int64)
    u = resample_u[torch.arange(batch), torch.tensor(accepted)]
    extra = draw_extra(p_row, q_row, d_m, torch.tensor(rejected), u).tolist()
    return [
        Verdict(accepted=m, tokens=d[:m] + [e], extra_kind=RECOVERED if r else BONUS)
        for d, m, e, r in zip(drafted, accepted, extra, rejected)
    ]


@dataclass(frozen=True)
class TargetScores:
    """What the target returned for one round's scored positions, as verification reads it.

    `argmax_ids` / `sampled_ids`: its own token after the committed tokens and after each drafted
    one (greedy: the argmax; coupled: its seeded draw); `probs`: p at those positions, where the
    round is verified by rejection sampling (None otherwise).
    """

    greedy: bool
    coupled: bool
    argmax_ids: Sequence[int] = ()
    sampled_ids: Sequence[int] = ()
    probs: torch.Tensor | None = None

    @property
    def by_rejection(self) -> bool:
        """Verified on p (rejection sampling), not on the target's own tokens."""
        return not (self.greedy or self.coupled)


def verify_round(
    drafted: Sequence[int],
    target: TargetScores,
    *,
    parents: Sequence[int] | None = None,
    draft_probs: torch.Tensor | None = None,
    seed: int = 0,
    position: int = 0,
) -> Verdict:
    """One round's verdict, by the mode its sampling and its drafts' shape call for.

    A token tree (`parents`) is verified by the target's own tokens when greedy or coupled
    (`verify_tree`), else by recursive rejection over siblings (`verify_tree_sampled`); a chain by
    `verify_greedy`, `verify_coupled` or exact rejection sampling on p and q (`verify_sampled`;
    `draft_probs` None: a deterministic proposal, one-hot q). `position` is the absolute position
    of the first drafted token.
    """
    own = target.argmax_ids if target.greedy else target.sampled_ids
    if parents is not None:
        if not target.by_rejection:
            return verify_tree(drafted, parents, list(own))
        return verify_tree_sampled(drafted, parents, _probs(target), seed=seed, position=position)
    if target.greedy:
        return verify_greedy(drafted, list(own))
    if target.coupled:
        return verify_coupled(drafted, list(own))
    return verify_sampled(drafted, draft_probs, _probs(target), seed=seed, position=position)


def _probs(target: TargetScores) -> torch.Tensor:
    if target.probs is None:
        raise ValueError("rejection sampling needs the target's distributions (TargetScores.probs)")
    return target.probs

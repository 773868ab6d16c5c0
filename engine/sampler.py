"""The outputs of one forward for all rows at once: argmax, distributions, draws, confidence.

Given the emitted logits of every row ([K, vocab], rows one after another), one
argmax covers all rows; the sampling distributions are computed once per
distinct SamplingParams in the forward (rows asking the same, the common case,
share one call of specdec.core.sampling.probs_from_logits); one inverse-CDF
draw covers every row that asked for draws, and the coupled sampler draws the
rows that asked for it, each from its own noise; one softmax gives the
confidence of rows that asked for it. Everything small comes to the host in one transfer, the
distributions in another (through pinned memory on a GPU), so a forward syncs
the device once however many rows it holds.

A row with a grammar mask (structured output) has its disallowed logits set to
-inf first, so its argmax, distributions and log-probabilities are the masked,
renormalised model's. A row asking for log-probabilities gets them from the
distribution it samples from, or, greedy, from the plain softmax (the greedy
distribution itself is one-hot).

Every transform works row by row, so a row's outputs do not depend on who else
is in the forward.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from engine.plan import RowLogprobs, RowOutput, RowPlan
from specdec.core import masks, rng
from specdec.core.sampling import SamplingParams, coupled_draws, probs_from_logits, sample, sampling_logits


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`; from a GPU through pinned memory without blocking the stream."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def outputs(rows: Sequence[RowPlan], logits: torch.Tensor) -> list[RowOutput]:
    """logits [sum(row.emit), vocab] on the model's device -> one RowOutput per row."""
    device = logits.device
    spans, at = [], 0
    for row in rows:
        spans.append((at, at + row.emit))
        at += row.emit
    _apply_masks(rows, spans, logits)
    argmax = logits.argmax(dim=-1)  # [K]
    # 1. Sampling logits and distributions, one call per distinct sampling parameters.
    scores_of, probs_of = _distributions(rows, spans, logits)
    # 2. Draws: every inverse-CDF row in one call; coupled rows each with their own noise.
    drawers = [i for i in sorted(probs_of) if rows[i].output.uniforms]
    sampled = None
    if drawers:
        p = torch.cat([probs_of[i][:len(rows[i].output.uniforms)] for i in drawers])
        u = torch.tensor([x for i in drawers for x in rows[i].output.uniforms], dtype=torch.float64)
        sampled = sample(p, u)  # [draws]
    coupled = {i: coupled_draws(scores, _noise_keys(rows[i])) for i, scores in scores_of.items()
               if rows[i].output.coupled_seed is not None and not rows[i].output.candidates}
    # 3. Confidence: the top probability of the plain softmax.
    confident = [i for i, row in enumerate(rows) if row.emit and row.output.top_prob]
    top = None
    if confident:
        index = _index([j for i in confident for j in range(*spans[i])], device)
        top = torch.softmax(logits.index_select(0, index).float(), dim=-1).amax(dim=-1)
    # 4. The distributions as one block (queued first), then everything small in one
    # transfer; that blocking copy also waits for the block on the same stream.
    host_probs = {}
    order = [i for i in sorted(probs_of) if rows[i].output.probs]
    if order:
        block = _to_host(torch.cat([probs_of[i] for i in order]))
        at = 0
        for i in order:
            n = rows[i].emit
            host_probs[i] = block[at:at + n]
            at += n
    logprobs = _logprobs(rows, spans, logits, argmax, probs_of, coupled)
    small = [argmax]
    if sampled is not None:
        small.append(sampled.to(argmax.device, torch.long))
    small += [coupled[i] for i in sorted(coupled)]
    values = torch.cat(small).tolist()
    top_values = top.tolist() if top is not None else []
    k = len(argmax)
    drawn, confident_set = set(drawers), set(confident)
    draws = iter(values[k:])
    tops = iter(top_values)
    result = []
    for i, row in enumerate(rows):
        lo, hi = spans[i]
        out_sampled = [next(draws) for _ in row.output.uniforms] if i in drawn else None
        out_top = [next(tops) for _ in range(row.emit)] if i in confident_set else None
        result.append(RowOutput(
            argmax=values[lo:hi],
            probs=host_probs.get(i) if row.output.probs else None,
            sampled=out_sampled,
            top_prob=out_top,
            logprobs=logprobs.get(i),
        ))
    for i in sorted(coupled):  # after every inverse-CDF draw, in row order
        result[i] = replace(result[i], sampled=[next(draws) for _ in range(rows[i].emit)])
    for i, found in _candidates(rows, spans, logits, scores_of).items():
        result[i] = replace(result[i], candidates=found)
    return result


def _candidates(rows: Sequence[RowPlan], spans: list[tuple[int, int]], logits: torch.Tensor,
                scores_of: dict[int, torch.Tensor]) -> dict[int, list[tuple[list[int], list[float]]]]:
    """Each asking row's top next tokens per emitted position (OutputSpec.candidates), one
    transfer per row: ranked by log q, or for a coupled row by log q + its Gumbel noise (the
    tokens most likely to be the target's draws)."""
    found = {}
    for i, row in enumerate(rows):
        n, (lo, hi) = row.output.candidates, spans[i]
        if not n or hi == lo:
            continue
        if row.output.sampling.greedy:
            lq = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        else:
            x = scores_of[i] if i in scores_of else sampling_logits(logits[lo:hi], row.output.sampling)
            lq = torch.log_softmax(x, dim=-1)
        rank = lq.double()
        if row.output.coupled_seed is not None and not row.output.sampling.greedy:
            keys = _noise_keys(row)
            rank = rank + torch.stack([rng.gumbel_noise(key, lq.shape[-1], lq.device) for key in keys])
        top = torch.topk(rank, min(n, lq.shape[-1]), dim=-1).indices  # [emit, n]
        ids, values = top.tolist(), lq.gather(1, top).tolist()
        found[i] = [([t for t, v in zip(r, vals) if v > float("-inf")], [v for v in vals if v > float("-inf")])
                    for r, vals in zip(ids, values)]  # never a token its distribution excludes
    return found


def _distributions(rows: Sequence[RowPlan], spans: list[tuple[int, int]], logits: torch.Tensor
                   ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per row that needs them: its sampling logits ([emit, vocab], sampled rows drawn by the
    coupled sampler) and its distributions ([emit, vocab] float32), one call per distinct
    SamplingParams in the forward (rows asking the same, the common case, share it)."""
    def wants_probs(row: RowPlan) -> bool:
        out = row.output
        return bool(out.probs or out.uniforms or (out.logprobs and not out.sampling.greedy))

    def wants_scores(row: RowPlan) -> bool:
        return row.output.coupled_seed is not None and not row.output.sampling.greedy

    by_params: dict[SamplingParams, list[int]] = {}
    for i, row in enumerate(rows):
        if row.emit and (wants_probs(row) or wants_scores(row)):
            by_params.setdefault(row.output.sampling, []).append(i)
    scores_of: dict[int, torch.Tensor] = {}
    probs_of: dict[int, torch.Tensor] = {}
    for params, members in by_params.items():
        index = _index([j for i in members for j in range(*spans[i])], logits.device)
        block = logits.index_select(0, index)
        if params.greedy:
            scores, probs = None, probs_from_logits(block, params)
        else:
            scores = sampling_logits(block, params)  # [n, vocab] float32
            probs = torch.softmax(scores, dim=-1) if any(wants_probs(rows[i]) for i in members) else None
        at = 0
        for i in members:
            n = rows[i].emit
            if scores is not None and wants_scores(rows[i]):
                scores_of[i] = scores[at:at + n]
            if probs is not None and wants_probs(rows[i]):
                probs_of[i] = probs[at:at + n]
            at += n
    return scores_of, probs_of


def _noise_keys(row: RowPlan) -> list[int]:
    """The coupled sampler's noise keys of a row's emitted positions: the logits of a token at
    position P draw the token at absolute index P + 1 (a tree node's P is its depth's)."""
    predicted = np.asarray(row.positions()[len(row.tokens) - row.emit:], dtype=np.int64) + 1
    return [int(key) for key in rng.gumbel_keys(row.output.coupled_seed, predicted)]


def _apply_masks(rows: Sequence[RowPlan], spans: list[tuple[int, int]], logits: torch.Tensor) -> None:
    """Disallowed tokens' logits -> -inf, in place, for the rows with a grammar mask."""
    for row, (lo, hi) in zip(rows, spans):
        if row.output.allowed and hi > lo:
            words = torch.from_numpy(masks.from_bytes(row.output.allowed, hi - lo).copy())
            allowed = masks.unpack(words.to(logits.device, non_blocking=True), logits.shape[-1])
            logits[lo:hi].masked_fill_(~allowed, float("-inf"))


def _logprobs(rows: Sequence[RowPlan], spans: list[tuple[int, int]], logits: torch.Tensor,
              argmax: torch.Tensor, probs_of: dict[int, torch.Tensor],
              coupled: dict[int, torch.Tensor]) -> dict[int, RowLogprobs]:
    """Each asking row's log-probabilities: of the next fed token, of the argmax, of its coupled
    draws (if any) and the top n. Two transfers for all rows together (floats, then ids).
    """
    asking = [i for i, row in enumerate(rows) if row.emit and row.output.logprobs]
    if not asking:
        return {}
    floats, ids = [], []
    for i in asking:
        row, (lo, hi) = rows[i], spans[i]
        emit, n = row.emit, row.output.logprobs
        if row.output.sampling.greedy:
            lp = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        else:
            lp = torch.log(probs_of[i])  # exactly 0 -> -inf: excluded by truncation or the mask
        fed = torch.tensor(list(row.tokens[len(row.tokens) - emit + 1:]), dtype=torch.long).to(lp.device)
        top = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)  # sorted, most likely first
        before = lp[:-1] if not row.output.tree_parents else lp.index_select(0, torch.tensor(
            [p + 1 for p in row.output.tree_parents], dtype=torch.long).to(lp.device))  # a node's parent
        floats += [before.gather(1, fed.unsqueeze(1)).squeeze(1),
                   lp.gather(1, argmax[lo:hi].unsqueeze(1)).squeeze(1), top.values.reshape(-1)]
        if i in coupled:
            floats.append(lp.gather(1, coupled[i].unsqueeze(1)).squeeze(1))
        ids.append(top.indices.reshape(-1))
    values = torch.cat(floats).tolist()
    top_ids = torch.cat(ids).tolist()
    result, at, at_ids = {}, 0, 0
    for i in asking:
        emit, n = rows[i].emit, min(rows[i].output.logprobs, logits.shape[-1])
        next_fed = values[at:at + emit - 1]
        at += emit - 1
        arg = values[at:at + emit]
        at += emit
        tv = values[at:at + emit * n]
        at += emit * n
        drawn = None
        if i in coupled:
            drawn = values[at:at + emit]
            at += emit
        ti = top_ids[at_ids:at_ids + emit * n]
        at_ids += emit * n
        result[i] = RowLogprobs(next_fed, arg, [ti[j * n:(j + 1) * n] for j in range(emit)],
                                [tv[j * n:(j + 1) * n] for j in range(emit)], drawn)
    return result

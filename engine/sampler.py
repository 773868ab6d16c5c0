"""The outputs of one forward for all rows at once: argmax, distributions, draws, confidence.

Given the emitted logits of every row ([K, vocab], rows one after another), one
argmax covers all rows; the sampling distributions are computed once per
distinct SamplingParams in the forward (rows asking the same, the common case,
share one call of specdec.core.sampling.probs_from_logits); one inverse-CDF
draw covers every row that asked for draws; one softmax gives the confidence of
rows that asked for it. Everything small comes to the host in one transfer, the
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

import torch

from engine.plan import RowLogprobs, RowOutput, RowPlan
from specdec.core import masks
from specdec.core.sampling import SamplingParams, probs_from_logits, sample


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
    # 1. Distributions, one call per distinct sampling parameters.
    wanted = [i for i, row in enumerate(rows) if row.emit and (
        row.output.probs or row.output.uniforms or (row.output.logprobs and not row.output.sampling.greedy))]
    by_params: dict[SamplingParams, list[int]] = {}
    for i in wanted:
        by_params.setdefault(rows[i].output.sampling, []).append(i)
    probs_of: dict[int, torch.Tensor] = {}  # row -> [emit, vocab] on the device
    for params, members in by_params.items():
        index = _index([j for i in members for j in range(*spans[i])], device)
        p = probs_from_logits(logits.index_select(0, index), params)  # [n, vocab] float32
        at = 0
        for i in members:
            n = rows[i].emit
            probs_of[i] = p[at:at + n]
            at += n
    # 2. Draws for the rows that asked, in one call.
    drawers = [i for i in wanted if rows[i].output.uniforms]
    sampled = None
    if drawers:
        p = torch.cat([probs_of[i][:len(rows[i].output.uniforms)] for i in drawers])
        u = torch.tensor([x for i in drawers for x in rows[i].output.uniforms], dtype=torch.float64)
        sampled = sample(p, u)  # [draws]
    # 3. Confidence: the top probability of the plain softmax.
    confident = [i for i, row in enumerate(rows) if row.emit and row.output.top_prob]
    top = None
    if confident:
        index = _index([j for i in confident for j in range(*spans[i])], device)
        top = torch.softmax(logits.index_select(0, index).float(), dim=-1).amax(dim=-1)
    # 4. The distributions as one block (queued first), then everything small in one
    # transfer; that blocking copy also waits for the block on the same stream.
    host_probs = {}
    if probs_of:
        order = [i for i in sorted(probs_of) if rows[i].output.probs]
        if order:
            block = _to_host(torch.cat([probs_of[i] for i in order]))
            at = 0
            for i in order:
                n = rows[i].emit
                host_probs[i] = block[at:at + n]
                at += n
    logprobs = _logprobs(rows, spans, logits, argmax, probs_of)
    small = [argmax]
    if sampled is not None:
        small.append(sampled.to(argmax.device, torch.long))
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
    return result


def _apply_masks(rows: Sequence[RowPlan], spans: list[tuple[int, int]], logits: torch.Tensor) -> None:
    """Disallowed tokens' logits -> -inf, in place, for the rows with a grammar mask."""
    for row, (lo, hi) in zip(rows, spans):
        if row.output.allowed and hi > lo:
            words = torch.from_numpy(masks.from_bytes(row.output.allowed, hi - lo).copy())
            allowed = masks.unpack(words.to(logits.device, non_blocking=True), logits.shape[-1])
            logits[lo:hi].masked_fill_(~allowed, float("-inf"))


def _logprobs(rows: Sequence[RowPlan], spans: list[tuple[int, int]], logits: torch.Tensor,
              argmax: torch.Tensor, probs_of: dict[int, torch.Tensor]) -> dict[int, RowLogprobs]:
    """Each asking row's log-probabilities: of the next fed token, of the argmax, and the top n.

    Two transfers for all rows together (floats, then ids).
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
        floats += [lp[:-1].gather(1, fed.unsqueeze(1)).squeeze(1),
                   lp.gather(1, argmax[lo:hi].unsqueeze(1)).squeeze(1), top.values.reshape(-1)]
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
        ti = top_ids[at_ids:at_ids + emit * n]
        at_ids += emit * n
        result[i] = RowLogprobs(next_fed, arg, [ti[j * n:(j + 1) * n] for j in range(emit)],
                                [tv[j * n:(j + 1) * n] for j in range(emit)])
    return result

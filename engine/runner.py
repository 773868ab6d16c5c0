"""The runner: executes one StepPlan as one forward over the KV pool.

Per step: reserve nothing (the scheduler did), pack every row's tokens into one
token axis, pad it to a token bucket where the device wants fixed shapes, plan
the attention groups (engine.model.attention), run engine.model.llama's forward once, and
turn the emitted logits into every row's outputs in one sampler call
(engine.sampler). The host builds a handful of index lists per step; the device
is synced once, when the small outputs come back.

Batch invariance per device (HostLimits.batch_invariant):
  * CPU: each linear pads its own token count M where its kernel needs it
    (engine.model.linear.calibrate; on this CPU in fp32 only the down projection,
    1 -> 2 tokens), attention groups rows by shape; no whole-forward padding.
  * CUDA: the packed token count and the emitted-logit count are padded to fixed
    buckets (TOKEN_BUCKETS), so every linear and norm sees one of a few shapes
    whoever shares the forward; padding is nearly free on a GPU.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from engine import sampler
from engine.model.attention import plan_attention
from engine.model.llama import LlamaForward, token_tensors
from engine.plan import LAST, RowOutput, StepPlan
from engine.pool import KVPool, SessionKV

TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The first bucket holding n (n itself beyond the largest)."""
    return next((b for b in buckets if b >= n), n)


def hidden_layers(plan: StepPlan) -> tuple[int, ...]:
    """The hidden states one forward hands back for the plan's rows (engine.plan.RowPlan.hidden):
    the one set every row asks for, else the union of them all (each row then takes its own)."""
    asked = {tuple(row.hidden) for row in plan.rows if row.hidden}
    if len(asked) <= 1:
        return next(iter(asked), LAST)
    return tuple(sorted({i for layers in asked for i in layers}))


class PooledRunner:
    """Runs plans through engine.model.llama's forward over one KV pool."""

    pooled = True

    def __init__(self, forward: LlamaForward, pool: KVPool, *, fixed_shapes: bool, max_rows: int):
        self.forward = forward
        self.pool = pool
        self.device = forward.device
        self.fixed_shapes = fixed_shapes
        self.max_rows = max_rows

    def new_cache(self) -> SessionKV:
        return self.pool.new_session()

    def run(self, plan: StepPlan) -> list[RowOutput]:
        logits, hidden = self.step(plan)
        outs = sampler.outputs(plan.rows, logits)
        if hidden is None:
            return outs
        host = hidden.float().cpu()  # [sum of hidden rows' tokens, len(hidden_layers(plan)) x H]
        blocks = hidden_layers(plan)
        width = host.shape[1] // len(blocks)
        at, result = 0, []
        for row, out in zip(plan.rows, outs):
            if row.hidden:
                n = len(row.tokens)
                mine = host[at:at + n]
                if tuple(row.hidden) != blocks:  # another row asked for other layers: this row's, in its order
                    mine = torch.cat([mine[:, blocks.index(i) * width:(blocks.index(i) + 1) * width]
                                      for i in row.hidden], dim=1)
                out = replace(out, hidden=mine)
                at += n
            result.append(out)
        return result

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """One forward; the emitted logits of every row, one row after another ([K, vocab])."""
        return self.step(plan)[0]

    def step(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward: the emitted logits ([K, vocab]) and, for rows asking, every token's normed hidden."""
        ids: list[int] = []
        positions: list[int] = []
        emitted: list[int] = []
        hidden: list[int] = []
        spec = []
        heads = self.forward.feature_dim > 0
        features: list[torch.Tensor] = []
        for row in plan.rows:
            n = len(row.tokens)
            assert row.cache.length == row.past, "the scheduler crops a session to its past first"
            spec.append((row.cache, row.past, n, row.tree))
            emitted.extend(range(len(ids) + n - row.emit, len(ids) + n))
            if row.hidden:
                hidden.extend(range(len(ids), len(ids) + n))
            if heads:
                if row.features is not None:
                    assert row.features.shape[0] == n, "one feature per token"
                    features.append(self.forward.input_features(
                        row.features.to(self.device, self.forward.dtype, non_blocking=True)))
                else:
                    features.append(torch.zeros(n, self.forward.feature_width, dtype=self.forward.dtype,
                                                device=self.device))
            ids.extend(row.tokens)
            positions.extend(row.positions())
        t, k = len(ids), len(emitted)
        padded = bucket(t, TOKEN_BUCKETS) if self.fixed_shapes else t
        ids.extend([0] * (padded - t))  # filler: token 0 at position 0, written to the scratch slot
        positions.extend([0] * (padded - t))
        n_emitted = bucket(max(k, 1), TOKEN_BUCKETS) if self.fixed_shapes else max(k, 1)
        emitted.extend([emitted[-1] if emitted else 0] * (n_emitted - k))
        attention = plan_attention(self.pool, spec, padded, self.device, self.forward.attention_dtype,
                                   multi_query=self.forward.multi_query, threads=self.forward.attention_threads)
        ids_t, positions_t, emitted_t = token_tensors(ids, positions, emitted, self.device)
        packed = None
        if heads:
            if padded > t:
                features.append(torch.zeros(padded - t, self.forward.feature_width, dtype=self.forward.dtype,
                                            device=self.device))
            packed = torch.cat(features)  # [padded, H]
        hidden_t = None
        if hidden:
            hidden_t = torch.tensor(hidden, dtype=torch.long).to(self.device, non_blocking=True)
        logits, states = self.forward.step(self.pool, ids_t, positions_t, attention, emitted_t, packed, hidden_t,
                                           hidden_layers(plan))
        for row in plan.rows:
            row.cache.length = row.past + len(row.tokens)
        return logits[:k], states  # [K, vocab], [hidden rows, H] or None

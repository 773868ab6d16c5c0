"""One forward pass as plain data: which sessions' rows, which tokens, which logits to keep.

The scheduler (engine.scheduler) builds a `StepPlan` each step; a runner
(engine.runner) executes it as one forward and hands back one `RowOutput` per
row. Both can be read and tested apart: a plan holds no tensors of the model
and a runner makes no scheduling decision.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core.sampling import SamplingParams

GREEDY = SamplingParams()


@dataclass(frozen=True)
class OutputSpec:
    """What a row wants from its kept positions besides the argmax (always computed)."""

    sampling: SamplingParams = GREEDY
    probs: bool = False  # the sampling distributions of every kept position
    uniforms: tuple[float, ...] = ()  # one draw per kept position from those distributions
    top_prob: bool = False  # the top probability of the plain softmax (a draft's confidence)


@dataclass(frozen=True)
class RowPlan:
    """One session's share of a forward: feed `tokens` at positions past.., keep the last `keep`."""

    cache: Any  # the session's KV handle (engine.pool.SessionKV, or engine.stock.DynamicKV)
    tokens: Sequence[int]
    past: int  # positions the cache holds before these tokens
    keep: int  # 0..len(tokens): logits kept from the end
    output: OutputSpec = field(default_factory=OutputSpec)


@dataclass(frozen=True)
class StepPlan:
    rows: Sequence[RowPlan]

    @property
    def tokens(self) -> int:
        return sum(len(row.tokens) for row in self.rows)


@dataclass(frozen=True)
class RowOutput:
    """What a row gets back, on the host: per kept position, in order."""

    argmax: list[int]
    probs: torch.Tensor | None = None  # [keep, vocab] float32 on the CPU (OutputSpec.probs)
    sampled: list[int] | None = None  # OutputSpec.uniforms
    top_prob: list[float] | None = None  # OutputSpec.top_prob

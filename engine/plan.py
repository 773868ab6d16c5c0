"""One forward pass as plain data: which sessions' rows, which tokens, which positions emit logits.

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
    """What a row wants from its emitted positions besides the argmax (always computed)."""

    sampling: SamplingParams = GREEDY
    probs: bool = False  # the sampling distributions of every emitted position
    uniforms: tuple[float, ...] = ()  # one draw per emitted position from those distributions
    # The coupled sampler (specdec.core.sampling.coupled_draws): one draw per emitted position
    # with the Gumbel noise of (coupled_seed, the drawn token's absolute position); None = none.
    coupled_seed: int | None = None
    # A token tree's expansion (draft_service.trees): the top `candidates` next tokens of every
    # emitted position, ranked by the row's log-probability (sampled: of its sampling
    # distribution, plus the coupled sampler's noise when coupled_seed is set); 0 = none.
    candidates: int = 0
    top_prob: bool = False  # the top probability of the plain softmax (a draft's confidence)
    # Structured output: packed little-endian int32 bitmasks, one row of words per
    # emitted position (bit j of word w allows token 32 w + j); b"" = no mask. The
    # logits of disallowed tokens become -inf before the argmax and the distributions.
    allowed: bytes = b""
    logprobs: int = 0  # top-n log-probabilities per emitted position (engine.sampler); 0 = none
    # The emitted positions after the first are a token tree's nodes (a Score of a tree): node j's
    # parent among them (-1: the first position). RowLogprobs.next_fed then holds each node's
    # log-probability under its parent's position, not under the position before it.
    tree_parents: tuple[int, ...] = ()


LAST = (-1,)  # RowPlan.hidden: the final hidden state


@dataclass(frozen=True)
class RowPlan:
    """One session's share of a forward: feed `tokens` at positions past.., output the logits of the last `emit`."""

    cache: Any  # the session's KV handle (engine.pool.SessionKV, or engine.stock.DynamicKV)
    tokens: Sequence[int]
    past: int  # positions the cache holds before these tokens
    emit: int  # 0..len(tokens): the last positions whose logits are output (emitted)
    output: OutputSpec = field(default_factory=OutputSpec)
    # A feature head (engine.model.drafts) reads one target feature per token ([len(tokens), H],
    # any device/dtype); None = zeros. Other models take none.
    features: Any = None
    # Hidden states of every token of this row to hand back (RowOutput.hidden): () = none;
    # LAST = the final one (a target's: after its final norm, what a feature head reads; a
    # feature head's: its own predicted feature); decoder layer ids = the residual stream
    # entering each of those layers, side by side (what an EAGLE-3 head reads).
    hidden: tuple[int, ...] = ()
    # The row's last tokens are token-tree nodes (engine.tree): their positions and what they see.
    tree: Any = None

    def positions(self) -> list[int]:
        """The rotary position of each token: past, past + 1, ... (tree nodes: by depth)."""
        n = len(self.tokens)
        if self.tree is None:
            return list(range(self.past, self.past + n))
        return list(range(self.past, self.past + self.tree.first)) + list(self.tree.positions)


@dataclass(frozen=True)
class StepPlan:
    rows: Sequence[RowPlan]

    @property
    def tokens(self) -> int:
        return sum(len(row.tokens) for row in self.rows)


@dataclass(frozen=True)
class RowOutput:
    """What a row gets back, on the host: per emitted position, in order."""

    argmax: list[int]
    probs: torch.Tensor | None = None  # [emit, vocab] float32 on the CPU (OutputSpec.probs)
    sampled: list[int] | None = None  # OutputSpec.uniforms or OutputSpec.coupled_seed
    top_prob: list[float] | None = None  # OutputSpec.top_prob
    logprobs: "RowLogprobs | None" = None  # OutputSpec.logprobs
    hidden: torch.Tensor | None = None  # [len(tokens), len(RowPlan.hidden) x H] float32 on the CPU
    # OutputSpec.candidates: per emitted position, (token ids best first, their log-probabilities)
    candidates: list[tuple[list[int], list[float]]] | None = None


@dataclass(frozen=True)
class RowLogprobs:
    """Log-probabilities of a row's emitted positions (the distribution: engine.sampler.logprobs)."""

    # [emit - 1]: of the token fed after each emitted position but the last (a tree: of each node,
    # under its parent's position, OutputSpec.tree_parents)
    next_fed: list[float]
    argmax: list[float]  # [emit]: of RowOutput.argmax[i]
    top_ids: list[list[int]]  # [emit][n], most likely first
    top_logprobs: list[list[float]]  # [emit][n]
    sampled: list[float] | None = None  # [emit]: of RowOutput.sampled[i] (coupled draws only)

"""The stock backend: one session per forward through the model's own forward and cache.

Serves models the engine's own forward does not know (engine.model.llama.unsupported)
and --max-batch 1. A session's cache is a transformers DynamicCache behind the
same interface as a pool session (length, crop, reserve, free, nbytes).

The cache keyword changed name across the transformers versions this project
admits (`past_key_values`, then `cache`, the old name deprecated); `CACHE_KWARG`
is the one the installed version's forward honours, found from its signature.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from engine import sampler
from engine.plan import RowOutput, StepPlan
from specdec.runtime.errors import FailedPrecondition


def cache_kwarg(model: torch.nn.Module) -> str:
    """'cache' where the model's forward takes it, else 'past_key_values'."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class DynamicKV:
    """A transformers DynamicCache with a pool session's interface."""

    def __init__(self, config: Any):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def reserve(self, total: int) -> None:  # grows on demand
        pass

    def crop(self, length: int) -> None:
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)  # a negative count drops from the end

    def free(self) -> None:
        self.crop(0)

    def copy_prefix(self, source: "DynamicKV", length: int) -> None:
        """Hold a copy of `source`'s first `length` positions."""
        import copy

        self.cache = copy.deepcopy(source.cache)
        self.crop(length)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors behind the cache (storage, so views count in full)."""
        total = 0
        for layer in getattr(self.cache, "layers", ()):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if tensor is not None:
                    total += tensor.untyped_storage().nbytes()
        return total


class StockRunner:
    """Runs a one-row StepPlan through model(...) with the row's DynamicCache."""

    max_rows = 1
    pooled = False

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.kwarg = cache_kwarg(model)

    def new_cache(self) -> DynamicKV:
        return DynamicKV(self.model.config)

    def run(self, plan: StepPlan) -> list[RowOutput]:
        return sampler.outputs(plan.rows, self.logits(plan))

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """One forward of the plan's one row; its emitted logits ([emit, vocab])."""
        (row,) = plan.rows
        if row.tree is not None:
            raise FailedPrecondition("parents: this replica serves its model through the stock forward "
                                     "(--max-batch 1, or an architecture the engine does not know), which "
                                     "verifies chains only, not token trees")
        if row.hidden or row.features is not None:
            raise FailedPrecondition("features: this replica serves its model through the stock forward "
                                     "(--max-batch 1, or an architecture the engine does not know), which "
                                     "neither returns nor reads target features")
        n = len(row.tokens)
        emit = max(row.emit, 1)  # transformers reads logits_to_keep=0 as "all"
        out = self.model(
            input_ids=torch.tensor([list(row.tokens)], dtype=torch.long, device=self.device),  # [1, n]
            position_ids=torch.arange(row.past, row.past + n, device=self.device).unsqueeze(0),  # [1, n]
            use_cache=True, logits_to_keep=emit, **{self.kwarg: row.cache.cache},
        )
        return out.logits[0, emit - row.emit:]  # [emit, vocab]

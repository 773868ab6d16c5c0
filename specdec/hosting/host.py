"""ModelHost: one loaded model, its KV caches and the one thread that runs it.

All model work runs on ONE worker thread per model (the model and its caches
are not re-entrant); the gRPC event loop only validates, queues and encodes.
The worker batches concurrent calls of different sessions into one forward
pass (specdec.hosting.batching, specdec.hosting.rows). What a call does with
the model is the role's (target_service.scoring, draft_service.drafting): a
`Work` that feeds tokens and takes logits step by step.

Two backends:
  * row-wise (--max-batch > 1, the default): many sessions per forward, each
    session's KV in its own growable buffers (rows.SessionKV). Chosen only if
    the model passes rows.unsupported's checks; otherwise a log line says why
    and the host falls back to the stock backend.
  * stock (--max-batch 1): one request per forward with a transformers
    DynamicCache per session, exactly the pre-batching path.

Numerics: every forward uses the session's own KV cache with explicit
`position_ids`, so Score over n new tokens equals n one-token Scores (greedy
identical; probabilities equal to ~1e-6 in float32, see tests/service). In the
row-wise backend a session's logits are bitwise the same alone and batched
(rows.calibrate).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from specdec.hosting import rows
from specdec.hosting.batching import BatchLimits, BatchWorker, SessionWork, Work
from specdec.hosting.kvcache import DynamicKV, KVCacheStore
from specdec.hosting.loader import LoadedModel

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["HostLimits", "ModelHost", "SessionWork", "Timed", "Work"]


@dataclass(frozen=True)
class HostLimits:
    max_sessions: int = 64
    cache_budget_bytes: int = 2 << 30
    session_ttl_s: float = 600.0
    max_k: int = 16  # largest k (drafted tokens) in one Propose or Score
    max_request_tokens: int = 8192  # tokens in one request; more is RESOURCE_EXHAUSTED
    max_batch: int = 16  # requests (sessions) per forward; 1 = batching off
    max_batch_tokens: int = 256  # tokens per forward (a lone larger step still runs)
    max_wait_us: int = 500  # wait for company this long, only when nothing is running
    # Pad row counts so a session's bits never depend on the batch (rows.calibrate).
    # Costs a lone 1-token decode ~45% (4 rows through the linears instead of 1).
    batch_invariant: bool = True


@dataclass(frozen=True)
class Timed:
    """A plain worker call's result with where the time went (milliseconds)."""

    value: Any
    queue_ms: float
    total_ms: float


class StockForward:
    """One session per forward over a transformers DynamicCache (batching off, or unsupported models)."""

    max_rows = 1

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device

    def new_cache(self) -> DynamicKV:
        return DynamicKV(self.model.config)

    def __call__(self, batch: Sequence[rows.Row]) -> list[torch.Tensor]:
        (row,) = batch
        start, n = row.kv.length, len(row.tokens)
        keep = max(row.keep, 1)  # transformers reads logits_to_keep=0 as "all"
        out = self.model(
            input_ids=torch.tensor([list(row.tokens)], dtype=torch.long, device=self.device),  # [1, n]
            position_ids=torch.arange(start, start + n, device=self.device).unsqueeze(0),  # [1, n]
            cache=row.kv.cache, use_cache=True, logits_to_keep=keep,
        )
        return [out.logits[0, keep - row.keep:]]  # [keep, vocab]


def pick_forward(loaded: LoadedModel, limits: HostLimits) -> StockForward | rows.RowsForward:
    """The row-wise backend where batching is on and the model passes its checks; else stock."""
    model = loaded.model
    if limits.max_batch <= 1:
        return StockForward(model)
    reason = rows.unsupported(model)
    if reason:
        log.warning("batching off for %s: %s; serving one request per forward", loaded.name, reason)
        return StockForward(model)
    if limits.batch_invariant:
        started = time.monotonic()
        # The most tokens one forward can hold: the budget, or one lone step of a
        # request (a prefill chunk's tail plus k + 1 scored positions).
        most_tokens = max(limits.max_batch_tokens, BatchLimits.prefill_chunk + limits.max_k + 1)
        most_kept = min(most_tokens, limits.max_batch * (limits.max_k + 1))
        tokens, kept = rows.calibrate(model, most_tokens, most_kept)
        log.info("batch-invariant row counts on %s (%d thread(s)): tokens %s, kept logits %s (%.1f s)",
                 loaded.device, torch.get_num_threads(), tokens, kept, time.monotonic() - started)
    else:
        log.info("batch invariance off: a session's logits may differ in the last bits with the batch")
        tokens = kept = rows.RowPadding.off()
    rows.enable(model)
    forward = rows.RowsForward(model, tokens, kept)
    forward.max_rows = limits.max_batch
    return forward


class ModelHost:
    """One model, its per-session KV caches and its worker thread; see the module docstring."""

    def __init__(self, loaded: LoadedModel, limits: HostLimits, *, replica_id: str = ""):
        self.loaded = loaded
        self.limits = limits
        self.replica_id = replica_id
        self.device = loaded.device
        self.eos_ids = frozenset(loaded.eos_token_ids)
        with torch.inference_mode():
            self.forward = pick_forward(loaded, limits)
        self.caches = KVCacheStore(
            self.forward.new_cache,
            max_sessions=limits.max_sessions,
            budget_bytes=limits.cache_budget_bytes,
            ttl_s=limits.session_ttl_s,
        )
        self.worker = BatchWorker(
            self.forward, self.caches,
            BatchLimits(max_batch=limits.max_batch, max_tokens=limits.max_batch_tokens,
                        max_wait_us=limits.max_wait_us),
        )
        log.info("batching: up to %d request(s) and %d tokens per forward, %d us wait when idle",
                 self.max_batch, limits.max_batch_tokens, limits.max_wait_us)

    @property
    def max_batch(self) -> int:
        """Requests per forward actually served (1 where the model runs unbatched)."""
        return self.worker.max_batch

    # ---- on the event loop -----------------------------------------------------

    async def serve(self, work: Work[T]) -> SessionWork[T]:
        """Run a Score or Propose on the worker, batched with whatever else is running."""
        return await self.worker.submit(work)

    async def run(self, fn: Callable[..., T], *args: Any) -> Timed:
        """Run `fn(*args)` on the worker between forwards (Release, the TTL sweep)."""
        submitted = time.perf_counter()
        value, queue_s = await self.worker.call(lambda: fn(*args))
        return Timed(value, queue_s * 1e3, (time.perf_counter() - submitted) * 1e3)

    def shutdown(self) -> None:
        self.worker.close()

    # ---- on the worker ---------------------------------------------------------

    def release(self, session_id: str) -> bool:
        return self.caches.release(session_id)

    def expire(self) -> int:
        return self.caches.expire()

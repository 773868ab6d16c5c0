"""ModelHost: one loaded model, its KV caches and the one thread that runs it.

All model work runs on ONE worker thread per model (the model and its caches
are not re-entrant); the gRPC event loop only validates, queues and encodes.
Calls for different sessions therefore interleave whole-call by whole-call.
What a call does with the model is the role's (target_service.scoring,
draft_service.drafting); this module only gives it a session's cache.

Numerics: every forward uses the session's own KV cache with explicit
`position_ids`, so Score over n new tokens equals n one-token Scores (greedy
identical; probabilities equal to ~1e-6 in float32, see tests/service).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from specdec.hosting import metrics
from specdec.hosting.kvcache import CachedSession, KVCacheStore
from specdec.hosting.loader import LoadedModel

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class HostLimits:
    max_sessions: int = 64
    cache_budget_bytes: int = 2 << 30
    session_ttl_s: float = 600.0
    max_k: int = 16  # largest k (drafted tokens) in one Propose or Score
    max_request_tokens: int = 8192  # tokens in one request; more is RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class Timed:
    """A worker result with where the time went (milliseconds)."""

    value: Any
    queue_ms: float
    total_ms: float


@dataclass(frozen=True)
class SessionWork(Generic[T]):
    """What `ModelHost.on_session` returns: the work's value and the cache afterwards."""

    value: T
    cache_length: int  # tokens the session holds after the call
    forward_ms: float


class ModelHost:
    """One model, its per-session KV caches and its worker thread; see the module docstring."""

    def __init__(self, loaded: LoadedModel, limits: HostLimits, *, replica_id: str = ""):
        from transformers import DynamicCache

        self.loaded = loaded
        self.limits = limits
        self.replica_id = replica_id
        self.device = loaded.device
        self.eos_ids = frozenset(loaded.eos_token_ids)
        config = loaded.model.config
        self.caches = KVCacheStore(
            lambda: DynamicCache(config=config),
            max_sessions=limits.max_sessions,
            budget_bytes=limits.cache_budget_bytes,
            ttl_s=limits.session_ttl_s,
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    # ---- on the event loop -----------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> Timed:
        """Run `fn(*args)` on the model worker; measure queueing and total time."""
        submitted = time.perf_counter()
        started: list[float] = []

        def call() -> T:
            started.append(time.perf_counter())
            with torch.inference_mode():
                return fn(*args)

        value = await asyncio.get_running_loop().run_in_executor(self._worker, call)
        done = time.perf_counter()
        queue_s = started[0] - submitted
        metrics.QUEUE_SECONDS.observe(queue_s)
        return Timed(value, queue_s * 1e3, (done - submitted) * 1e3)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)

    # ---- on the worker ---------------------------------------------------------

    def on_session(
        self, session_id: str, cache_position: int, prefix_hash: int,
        work: Callable[[CachedSession], T],
    ) -> SessionWork[T]:
        """Run `work` on the session's cache after the cache check (CacheMiss if it fails).

        A session whose work raised may hold a half-extended cache, so it is forgotten.
        """
        session = self.caches.acquire(session_id, cache_position, prefix_hash)
        started = time.perf_counter()
        try:
            value = work(session)
        except BaseException:
            self.caches.discard(session_id)
            raise
        forward_ms = (time.perf_counter() - started) * 1e3
        self.caches.settle(session)
        return SessionWork(value, session.length, forward_ms)

    def forward(self, session: CachedSession, tokens: Sequence[int], keep: int) -> torch.Tensor:
        """Append `tokens` to the session's cache; logits of the last `keep` positions."""
        start = session.length
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        out = self.loaded.model(
            input_ids=ids, position_ids=positions, cache=session.cache, use_cache=True,
            logits_to_keep=keep,
        )
        session.append(tokens)
        return out.logits[0, -keep:]  # [keep, vocab]

    def release(self, session_id: str) -> bool:
        return self.caches.release(session_id)

    def expire(self) -> int:
        return self.caches.expire()

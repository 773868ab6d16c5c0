"""Continuous cross-session batching: the model worker thread and its queue.

ONE worker thread per model owns the model and the KV-cache store; the gRPC
event loop only validates, enqueues and awaits a future. Each turn of the
worker builds one forward pass:

  1. the running jobs first, one row each: a Propose drafting its next token,
     a long request feeding its next prefill chunk. A running job is never
     delayed for a newcomer;
  2. then new jobs from the queue (FIFO) while the forward has fewer than
     `max_batch` rows and `max_tokens` tokens. A job whose session is already
     running waits for the next forward (one row per session per forward). The
     worker waits up to `max_wait_us` for more jobs only when nothing is
     running, so batching never adds latency under load;
  3. one forward; every row's logits go to its job's `advance` (role code:
     target_service.scoring, draft_service.drafting), which returns the next
     step or finishes. A Propose with a smaller k simply leaves early.

The cache check (`KVCacheStore.acquire`) happens when a job joins: a CacheMiss
fails that job alone. A forward that raises fails every job in it and forgets
their sessions (their caches may be half-extended). A cancelled job leaves at
the next step boundary; its session stays consistent, since fingerprints are
appended per fed chunk.

Prefill chunks sit at fixed absolute positions (multiples of `prefill_chunk`),
so how a request is split never depends on the load: a session's numerics are
the same alone and batched (see specdec.hosting.rows for the rest of that).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from specdec.errors import CacheMiss, Unavailable
from specdec.hosting import metrics
from specdec.hosting.kvcache import CachedSession, KVCacheStore
from specdec.hosting.rows import Row

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 16  # rows (sessions) in one forward; 1 = one request per forward
    max_tokens: int = 256  # tokens in one forward (a lone larger step still runs)
    max_wait_us: int = 500  # wait this long for company, only when nothing is running
    prefill_chunk: int = 64  # split longer feeds at multiples of this position; 0 = never


class Step(NamedTuple):
    """Feed `tokens` to the session's cache; hand back the logits of the last `keep`."""

    tokens: Sequence[int]
    keep: int


class Work(ABC, Generic[T]):
    """What one Score or Propose does with the model, step by step (on the worker)."""

    verb: str  # "score" / "propose": metrics label
    session_id: str
    cache_position: int
    prefix_hash: int

    @abstractmethod
    def begin(self) -> Step:
        """The first step (from the request alone; may be called again if the job is deferred)."""

    @abstractmethod
    def advance(self, session: CachedSession, logits: torch.Tensor) -> Step | None:
        """Take the last step's logits ([keep, vocab]); the next step, or None when done."""

    @abstractmethod
    def result(self) -> T:
        """The call's value once done."""


class Forward(Protocol):
    """A model backend: the row-wise packed forward, or the stock one-session forward."""

    max_rows: int

    def new_cache(self) -> Any: ...

    def __call__(self, rows: Sequence[Row]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class SessionWork(Generic[T]):
    """What a Score or Propose returns: its value, the cache afterwards, and its timing."""

    value: T
    cache_length: int  # tokens the session holds after the call
    queue_ms: float  # enqueued -> joined a forward
    forward_ms: float  # sum of the forwards this call took part in
    batch_rows: int  # rows of the largest forward (most rows) that served this call
    batch_tokens: int  # tokens of that same forward
    forwards: int  # forward passes that served this call


@dataclass(eq=False)
class _Job:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    work: Work | None = None
    call: Callable[[], Any] | None = None  # a plain function to run between forwards
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    session: CachedSession | None = None
    feed: Sequence[int] = ()  # tokens of the current step not fed yet
    keep: int = 0
    chunk: int = 0  # tokens of `feed` in the next forward
    chunk_keep: int = 0
    forward_s: float = 0.0
    forwards: int = 0
    rows: int = 0
    tokens: int = 0


def chunk_of(position: int, n: int, keep: int, size: int) -> tuple[int, int]:
    """(tokens, kept logits) of the next forward for a feed of `n` tokens at `position`.

    Cuts at the next multiple of `size` unless the cut would split off a kept
    position: the last chunk holds every kept token.
    """
    if size > 0:
        boundary = (position // size + 1) * size
        if boundary <= position + n - max(keep, 1):
            return boundary - position, 0
    return n, keep


def _settle(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class BatchWorker:
    """The model worker thread: continuous batching of Work over one Forward backend."""

    def __init__(self, forward: Forward, store: KVCacheStore, limits: BatchLimits, *, name: str = "model"):
        self.forward = forward
        self.store = store
        self.max_batch = max(1, min(limits.max_batch, forward.max_rows))
        self.max_tokens = max(1, limits.max_tokens)
        self.max_wait_s = max(0, limits.max_wait_us) / 1e6
        self.chunk = limits.prefill_chunk if self.max_batch > 1 else 0  # 1 = today's one forward per call
        self._queue: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: list[_Job] = []  # joined, not finished (touched by the worker only)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-worker", daemon=True)
        self._thread.start()

    # ---- on the event loop -----------------------------------------------------

    async def submit(self, work: Work[T]) -> SessionWork[T]:
        return await self._enqueue(_Job(*self._future(), work=work))

    async def call(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run `fn()` on the worker between forwards; (value, seconds queued)."""
        job = _Job(*self._future(), call=fn)
        value = await self._enqueue(job)
        return value, job.started - job.enqueued

    def _future(self) -> tuple[asyncio.Future, asyncio.AbstractEventLoop]:
        loop = asyncio.get_running_loop()
        return loop.create_future(), loop

    async def _enqueue(self, job: _Job) -> Any:
        with self._cv:
            if self._stopping:
                raise Unavailable("the model worker is shutting down")
            self._queue.append(job)
            self._cv.notify()
        return await job.future  # cancelling the caller cancels the future: the job leaves

    def close(self) -> None:
        """Stop after the current forward; fail whatever is still queued or running."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    # ---- on the worker ---------------------------------------------------------

    def _resolve(self, job: _Job, value: Any = None, error: BaseException | None = None) -> None:
        try:
            job.loop.call_soon_threadsafe(_settle, job.future, value, error)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting
            pass

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                batch = self._gather()
                if batch is None:
                    break
                if batch:
                    self._step(batch)
        error = Unavailable("the model worker is shutting down")
        for job in [*self._running, *self._queue]:
            self._resolve(job, error=error)
        self._running.clear()
        self._queue.clear()

    def _plan(self, job: _Job, step: Step) -> None:
        job.feed, job.keep = list(step.tokens), step.keep
        self._plan_chunk(job, job.session.length)

    def _plan_chunk(self, job: _Job, position: int) -> None:
        job.chunk, job.chunk_keep = chunk_of(position, len(job.feed), job.keep, self.chunk)

    def _gather(self) -> list[_Job] | None:
        """The jobs of the next forward (running ones first), or None to stop."""
        batch: list[_Job] = []
        tokens = 0
        busy: set[str] = set()
        running = []
        for job in self._running:
            if job.future.cancelled():  # left at a step boundary; its cache is consistent
                self.store.settle(job.session)
                continue
            running.append(job)
            busy.add(job.work.session_id)
            if batch and (len(batch) >= self.max_batch or tokens + job.chunk > self.max_tokens):
                continue  # next forward
            batch.append(job)
            tokens += job.chunk
        self._running = running
        idle = not running
        deadline: float | None = None
        deferred: list[_Job] = []
        try:
            while len(batch) < self.max_batch:
                with self._cv:
                    while not self._queue and not self._stopping:
                        if not batch and not self._running:
                            self._cv.wait()  # nothing to do at all
                            continue
                        if not idle:
                            break  # others are running: never wait for company
                        now = time.perf_counter()
                        deadline = deadline if deadline is not None else now + self.max_wait_s
                        if now >= deadline:
                            break
                        self._cv.wait(deadline - now)
                    if self._stopping:
                        return None
                    if not self._queue:
                        break
                    job = self._queue.popleft()
                if job.call is not None:
                    self._run_call(job)
                    continue
                if job.future.cancelled():
                    continue
                work = job.work
                if work.session_id in busy:
                    deferred.append(job)  # one row per session per forward; keeps its order
                    continue
                step = work.begin()
                n, _ = chunk_of(work.cache_position, len(step.tokens), step.keep, self.chunk)
                if batch and tokens + n > self.max_tokens:
                    deferred.append(job)
                    continue
                try:
                    job.session = self.store.acquire(work.session_id, work.cache_position, work.prefix_hash)
                except CacheMiss as exc:  # this request alone; nothing changed
                    self._resolve(job, error=exc)
                    continue
                job.started = time.perf_counter()
                metrics.QUEUE_SECONDS.observe(job.started - job.enqueued)
                self._plan(job, step)
                busy.add(work.session_id)
                batch.append(job)
                self._running.append(job)
                tokens += job.chunk
        finally:
            if deferred:
                with self._cv:
                    self._queue.extendleft(reversed(deferred))
        return batch

    def _run_call(self, job: _Job) -> None:
        job.started = time.perf_counter()
        metrics.QUEUE_SECONDS.observe(job.started - job.enqueued)
        try:
            self._resolve(job, job.call())
        except Exception as exc:
            self._resolve(job, error=exc)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        """The job's cache may be half-extended: forget the session; fail the call."""
        self.store.discard(job.work.session_id)
        self._running.remove(job)
        self._resolve(job, error=exc)

    def _step(self, batch: list[_Job]) -> None:
        rows = [Row(job.session.cache, job.feed[:job.chunk], job.chunk_keep) for job in batch]
        tokens = sum(job.chunk for job in batch)
        started = time.perf_counter()
        try:
            logits = self.forward(rows)
        except Exception as exc:
            log.exception("forward over %d session(s) failed", len(batch))
            for job in batch:
                self._fail(job, exc)
            return
        elapsed = time.perf_counter() - started
        metrics.BATCH_ROWS.observe(len(batch))
        metrics.BATCH_TOKENS.observe(tokens)
        for job, out in zip(batch, logits):
            job.forward_s += elapsed
            job.forwards += 1
            if len(batch) >= job.rows:
                job.rows, job.tokens = len(batch), tokens
            fed = job.feed[:job.chunk]
            job.session.append(fed)
            job.feed = job.feed[job.chunk:]
            if job.feed:  # the next prefill chunk of this step
                self._plan_chunk(job, job.session.length)
                continue
            try:
                step = job.work.advance(job.session, out)
            except Exception as exc:
                log.exception("%s on session %r failed", job.work.verb, job.work.session_id)
                self._fail(job, exc)
                continue
            if step is not None:
                self._plan(job, step)
                continue
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._running.remove(job)
        self.store.settle(job.session)
        metrics.FORWARD_SECONDS.labels(job.work.verb).observe(job.forward_s)
        self._resolve(job, SessionWork(
            value=job.work.result(), cache_length=job.session.length,
            queue_ms=(job.started - job.enqueued) * 1e3, forward_ms=job.forward_s * 1e3,
            batch_rows=job.rows, batch_tokens=job.tokens, forwards=job.forwards,
        ))

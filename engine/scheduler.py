"""The scheduler: the model worker thread, its queue, and one StepPlan per forward.

ONE worker thread per model owns the runner and the KV-cache store; the gRPC
event loop only validates, enqueues and awaits a future. Each turn the worker
builds one `engine.plan.StepPlan`:

  1. the running jobs first, one row each: a Propose drafting its next token,
     a long request feeding its next prefill chunk. A running job is never
     delayed for a newcomer;
  2. then new jobs from the queue (FIFO) while the forward has fewer than
     `max_batch` rows and `max_tokens` tokens. A job whose session is already
     running waits for the next forward (one row per session per forward). The
     worker waits up to `max_wait_us` for more jobs only when nothing is
     running, so batching never adds latency under load;
  3. the runner executes the plan as one forward; each row's outputs go to its
     job's `advance` (role code: target_service.scoring,
     draft_service.drafting), which returns the next step or finishes. A
     Propose with a smaller k simply leaves early.

The cache check (`SessionCaches.acquire`) happens when a job joins: a CacheMiss
fails that job alone. Room in the KV pool is reserved when a step is planned;
a full pool evicts the least recently used idle sessions, and a job that still
does not fit fails alone with RESOURCE_EXHAUSTED. A forward that runs out of
memory evicts idle sessions and is retried once, then fails its jobs with
RESOURCE_EXHAUSTED; any other failed forward fails every job in it and forgets
their sessions. A cancelled job leaves at the next step boundary; its session
stays consistent, since fingerprints are appended per fed chunk.

Faults that leave the worker unable to serve (its thread dying, a sticky CUDA
error) go to `on_fatal`, which the host turns into NOT_SERVING and an exit.

Prefill chunks sit at fixed absolute positions (multiples of `prefill_chunk`),
so how a request is split never depends on the load.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch

from engine import metrics
from engine.plan import OutputSpec, RowOutput, RowPlan, StepPlan
from engine.pool import PoolExhausted
from engine.sessions import CachedSession, SessionCaches
from engine.tree import PendingTree, TreeRow
from specdec.runtime.errors import CacheMiss, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 64  # rows (sessions) in one forward; 1 = one request per forward
    max_tokens: int = 256  # tokens in one forward (a lone larger step still runs)
    max_wait_us: int = 0  # wait this long for company, only when nothing is running
    prefill_chunk: int = 64  # split longer feeds at multiples of this position; 0 = never


class Step(NamedTuple):
    """Feed `tokens` to the session's cache; hand back the outputs (logits) of the last `emit`."""

    tokens: Sequence[int]
    emit: int
    output: OutputSpec = OutputSpec()
    features: Any = None  # a feature head's input features, one per token ([len(tokens), H])
    hidden: tuple[int, ...] = ()  # hand back every fed token's hidden states (engine.plan.RowPlan.hidden)
    # The last len(parents) tokens are token-tree nodes (engine.tree): each one's parent, an
    # earlier node of the session's pending tree or of this step, or -1 (the last held token).
    # Every tree node is emitted (emit >= len(parents)), so a step's tree is never split.
    parents: Sequence[int] | None = None


class Work(ABC, Generic[T]):
    """What one Score or Propose does with the model, step by step (on the worker)."""

    verb: str  # "score" / "propose": metrics label
    session_id: str
    cache_position: int
    prefix_hash: int
    tenant: str = ""  # the request's tenant (ScoreRequest.tenant): a new session's, for fair eviction

    @abstractmethod
    def begin(self) -> Step:
        """The first step (from the request alone; may be called again if the job is deferred)."""

    def joined(self, session: CachedSession, step: Step) -> Step:
        """The first step again, once the session is acquired (a feature head reads its state); may
        raise CacheMiss."""
        return step

    @abstractmethod
    def advance(self, session: CachedSession, out: RowOutput) -> Step | None:
        """Take the last step's outputs; the next step, or None when done."""

    @abstractmethod
    def result(self) -> T:
        """The call's value once done."""


class Runner(Protocol):
    """Executes a StepPlan: engine.runner.PooledRunner or engine.stock.StockRunner."""

    max_rows: int

    def new_cache(self) -> Any: ...

    def run(self, plan: StepPlan) -> list[RowOutput]: ...


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
    emit: int = 0  # the current step's emitted positions
    output: OutputSpec = OutputSpec()
    chunk: int = 0  # tokens of `feed` in the next forward
    chunk_emit: int = 0  # of `emit`, those in the next forward (engine.plan.RowPlan.emit)
    features: Any = None  # of the current step, the rows of `feed` (sliced along with it)
    hidden: tuple[int, ...] = ()
    parents: Sequence[int] | None = None  # the current step's tree nodes (Step.parents)
    hidden_parts: list = field(default_factory=list)  # the current step's hidden states so far
    forward_s: float = 0.0
    forwards: int = 0
    rows: int = 0
    tokens: int = 0


def chunk_of(position: int, n: int, emit: int, size: int) -> tuple[int, int]:
    """(tokens, emitted positions) of the next forward for a feed of `n` tokens at `position`.

    Cuts at the next multiple of `size` unless the cut would split off an emitted
    position: the last chunk holds every emitted position.
    """
    if size > 0:
        boundary = (position // size + 1) * size
        if boundary <= position + n - max(emit, 1):
            return boundary - position, 0
    return n, emit


def out_of_memory(exc: BaseException) -> bool:
    """A device or host allocation failure (retry after freeing), not a bug."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def fatal_error(exc: BaseException) -> bool:
    """A failure after which the device cannot be trusted: the process must go."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("CUDA error", "device-side assert", "illegal memory access",
                                  "CUBLAS_STATUS", "cudaError"))


def _settle(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _settle_all(outcomes: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, value, error in outcomes:
        _settle(future, value, error)


class Scheduler:
    """The model worker thread: continuous batching of Work over one Runner."""

    def __init__(self, runner: Runner, store: SessionCaches, limits: BatchLimits, *, name: str = "model",
                 on_fatal: Callable[[str], None] | None = None):
        self.runner = runner
        self.store = store
        self.max_batch = max(1, min(limits.max_batch, runner.max_rows))
        self.max_tokens = max(1, limits.max_tokens)
        self.max_wait_s = max(0, limits.max_wait_us) / 1e6
        self.chunk = limits.prefill_chunk if self.max_batch > 1 else 0  # 1 = one forward per call
        self.on_fatal = on_fatal or (lambda reason: None)
        self.fatal: str | None = None
        self.forward_started: float | None = None  # perf_counter of the forward running now
        self._queue: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: list[_Job] = []  # joined, not finished (touched by the worker only)
        # Outcomes resolved on the worker and not yet handed to their event loops (_deliver).
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Any, BaseException | None]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=f"{name}-worker", daemon=True)
        self._thread.start()

    # ---- on the event loop -----------------------------------------------------

    async def submit(self, work: Work[T]) -> SessionWork[T]:
        return await self._enqueue(_Job(*self._future(), work=work))

    async def submit_many(self, works: Sequence[Work]) -> list[SessionWork | BaseException]:
        """Several calls queued at once (one wake-up), so they can share the next forward;
        each outcome is its value or its exception."""
        loop = asyncio.get_running_loop()
        jobs = [_Job(loop.create_future(), loop, work=work) for work in works]
        with self._cv:
            if self.fatal is not None:
                raise Unavailable(f"the model worker stopped: {self.fatal}")
            if self._stopping:
                raise Unavailable("the model worker is shutting down")
            self._queue.extend(jobs)
            self._cv.notify()
        return await asyncio.gather(*(job.future for job in jobs), return_exceptions=True)

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
            if self.fatal is not None:
                raise Unavailable(f"the model worker stopped: {self.fatal}")
            if self._stopping:
                raise Unavailable("the model worker is shutting down")
            self._queue.append(job)
            self._cv.notify()
        return await job.future  # cancelling the caller cancels the future: the job leaves

    @property
    def queued(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Stop after the current forward; fail whatever is still queued or running."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    # ---- on the worker ---------------------------------------------------------

    def _resolve(self, job: _Job, value: Any = None, error: BaseException | None = None) -> None:
        """The job's outcome, handed over at the next _deliver (before the worker waits or
        after a forward): a forward's rows wake their event loop once, not once each."""
        self._outbox.append((job.loop, job.future, value, error))

    def _deliver(self) -> None:
        """Every resolved outcome to its event loop: one wake-up per loop."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, future, value, error in outbox:
            by_loop.setdefault(loop, []).append((future, value, error))
        for loop, outcomes in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, outcomes)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting
                pass

    def _main(self) -> None:
        try:
            self._loop()
            error: BaseException = Unavailable("the model worker is shutting down")
        except BaseException as exc:  # the worker must never die silently
            log.critical("the model worker died", exc_info=True)
            self.fatal = f"{type(exc).__name__}: {exc}"
            error = Unavailable(f"the model worker stopped: {type(exc).__name__}")
            self.on_fatal(self.fatal)
        with self._cv:
            pending = [*self._running, *self._queue]
            self._running.clear()
            self._queue.clear()
        for job in pending:
            self._resolve(job, error=error)
        self._deliver()

    def _loop(self) -> None:
        with torch.inference_mode():
            while self.fatal is None:
                try:
                    batch = self._gather()
                    if batch is None:
                        break
                    if batch:
                        self._step(batch)
                finally:
                    self._deliver()

    def _plan(self, job: _Job, step: Step) -> None:
        job.feed, job.emit, job.output = list(step.tokens), step.emit, step.output
        job.features, job.hidden, job.hidden_parts = step.features, step.hidden, []
        job.parents = step.parents or None
        if job.parents is not None and step.emit < len(job.parents):
            raise ValueError("a tree step emits every one of its nodes")
        self._plan_chunk(job, job.session.stored)

    def _plan_chunk(self, job: _Job, position: int) -> None:
        job.chunk, job.chunk_emit = chunk_of(position, len(job.feed), job.emit, self.chunk)

    def _reserve(self, job: _Job, busy: set[str]) -> bool:
        """Room in the pool for the job's next chunk, evicting idle sessions; False: failed alone."""
        session = job.session
        while True:
            try:
                session.cache.reserve(session.stored + job.chunk)
                return True
            except PoolExhausted as exc:
                if not self.store.evict_idle(busy | {job.work.session_id}, "budget"):
                    self._fail(job, exc)
                    return False

    def _gather(self) -> list[_Job] | None:
        """The jobs of the next forward (running ones first), or None to stop."""
        batch: list[_Job] = []
        tokens = 0
        busy: set[str] = set()
        running = []
        for job in self._running:
            if job.future.cancelled():  # left at a step boundary; its cache is consistent
                self.store.unpin(job.session)
                self.store.settle(job.session)
                continue
            running.append(job)
            busy.add(job.work.session_id)
        self._running = running
        for job in list(running):
            if batch and (len(batch) >= self.max_batch or tokens + job.chunk > self.max_tokens):
                continue  # next forward
            if not self._reserve(job, busy):
                continue
            batch.append(job)
            tokens += job.chunk
        idle = not self._running
        deadline: float | None = None
        deferred: list[_Job] = []
        try:
            while len(batch) < self.max_batch:
                with self._cv:
                    while not self._queue and not self._stopping:
                        self._deliver()  # nothing resolved waits out the worker's waits below
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
                n, _ = chunk_of(work.cache_position, len(step.tokens), step.emit, self.chunk)
                if batch and tokens + n > self.max_tokens:
                    deferred.append(job)
                    continue
                try:
                    job.session = self.store.acquire(work.session_id, work.cache_position, work.prefix_hash,
                                                     work.tenant)
                    step = work.joined(job.session, step)
                except CacheMiss as exc:  # this request alone; nothing changed
                    self._resolve(job, error=exc)
                    continue
                self.store.pin(job.session)
                job.started = time.perf_counter()
                metrics.QUEUE_SECONDS.observe(job.started - job.enqueued)
                self._plan(job, step)
                self._running.append(job)
                if not self._reserve(job, busy):
                    continue
                busy.add(work.session_id)
                batch.append(job)
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
        self.store.discard(job.session)
        if job in self._running:
            self._running.remove(job)
        self.store.unpin(job.session)
        self._resolve(job, error=exc)

    def _forward(self, plan: StepPlan, batch: list[_Job]) -> list[RowOutput]:
        """runner.run, with one retry after freeing idle sessions when memory runs out."""
        busy = {job.work.session_id for job in self._running}
        for attempt in (1, 2):
            try:
                return self.runner.run(plan)
            except Exception as exc:
                if not out_of_memory(exc) or attempt == 2:
                    raise
                freed = 0
                while self.store.evict_idle(busy, "out_of_memory"):
                    freed += 1
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                log.warning("out of memory in a forward over %d session(s); evicted %d idle "
                            "session(s), retrying once", len(batch), freed)
        raise AssertionError("unreachable")

    def _step(self, batch: list[_Job]) -> None:
        plan = StepPlan([
            RowPlan(job.session.cache, job.feed[:job.chunk], job.session.stored, job.chunk_emit,
                    job.output if job.chunk == len(job.feed) else OutputSpec(),
                    features=job.features[:job.chunk] if job.features is not None else None,
                    hidden=job.hidden, tree=self._tree_row(job))
            for job in batch
        ])
        tokens = plan.tokens
        started = time.perf_counter()
        self.forward_started = started
        try:
            outs = self._forward(plan, batch)
        except Exception as exc:
            if fatal_error(exc):
                raise  # the worker's guard: NOT_SERVING and exit
            if out_of_memory(exc):
                log.error("out of memory again in a forward over %d session(s): failing them", len(batch))
                error: BaseException = ResourceExhausted(
                    "out of memory on the model's device, even after evicting idle sessions; "
                    "retry later or with fewer tokens")
            else:
                log.exception("forward over %d session(s) failed", len(batch))
                error = exc
            for job in batch:
                self._fail(job, error)
            return
        finally:
            self.forward_started = None
        elapsed = time.perf_counter() - started
        metrics.PASS_SECONDS.inc(elapsed)
        metrics.BATCH_ROWS.observe(len(batch))
        metrics.BATCH_TOKENS.observe(tokens)
        for job, out in zip(batch, outs):
            job.forward_s += elapsed
            job.forwards += 1
            if len(batch) >= job.rows:
                job.rows, job.tokens = len(batch), tokens
            fed = job.feed[:job.chunk]
            job.session.append(fed, job.parents if job.chunk == len(job.feed) else None)
            job.feed = job.feed[job.chunk:]
            if job.features is not None:
                job.features = job.features[job.chunk:]
            if job.hidden and out.hidden is not None:
                job.hidden_parts.append(out.hidden)
            if job.feed:  # the next prefill chunk of this step
                self._plan_chunk(job, job.session.stored)
                continue
            if job.hidden and len(job.hidden_parts) > 1:
                out = replace(out, hidden=torch.cat(job.hidden_parts))
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

    @staticmethod
    def _tree_row(job: _Job) -> TreeRow | None:
        """The last chunk of a tree step: where its nodes sit and what each sees (engine.tree)."""
        if job.parents is None or job.chunk != len(job.feed):
            return None
        session = job.session
        tree = session.tree if session.tree is not None else PendingTree(
            session.length + job.chunk - len(job.parents), 0)
        return tree.row(job.chunk - len(job.parents), job.parents)

    def _finish(self, job: _Job) -> None:
        self._running.remove(job)
        self.store.unpin(job.session)
        self.store.settle(job.session)
        metrics.FORWARD_SECONDS.labels(job.work.verb).observe(job.forward_s)
        self._resolve(job, SessionWork(
            value=job.work.result(), cache_length=job.session.length,
            queue_ms=(job.started - job.enqueued) * 1e3, forward_ms=job.forward_s * 1e3,
            batch_rows=job.rows, batch_tokens=job.tokens, forwards=job.forwards,
        ))

"""ModelHost: one loaded model, its KV pool and sessions, and the one thread that runs it.

All model work runs on ONE worker thread per model (engine.scheduler); the gRPC
event loop only validates, queues and encodes. What a call does with the model
is the role's (target_service.scoring, draft_service.drafting): a `Work` that
feeds tokens and takes outputs step by step.

Two runners:
  * pooled (the default, --max-batch > 1): the engine's own forward
    (engine.model.llama) over one preallocated KV pool, many sessions per forward.
    Chosen where the model's architecture is known and the start-up
    self-check agrees with the model's own forward (engine.selfcheck);
    otherwise a log line says why and the host uses
  * stock (--max-batch 1, or a model the engine does not know): one request
    per forward through the model's own forward and a DynamicCache.

Faults: a worker thread that dies, or a forward stuck longer than
`stall_timeout_s`, or a sticky device error, calls `on_fatal` once (the server
then turns NOT_SERVING and exits, so the orchestrator moves the sessions).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine import metrics, selfcheck
from engine.model.linear import calibrate
from engine.model.llama import LlamaForward, unsupported
from engine.model.loader import LoadedModel
from engine.runner import PooledRunner
from engine.scheduler import BatchLimits, Scheduler, SessionWork, Work
from engine.sessions import SessionCaches
from engine.stock import StockRunner
from specdec.core.bounds import MAX_K

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["HostLimits", "ModelHost", "SessionWork", "Timed", "Work"]

POOL_SHARE_OF_FREE_GPU = 0.85  # on a GPU, the KV pool takes this much of what is free after loading


@dataclass(frozen=True)
class HostLimits:
    max_sessions: int = 64
    cache_budget_bytes: int | None = 2 << 30  # None: CPU 2 GiB, GPU a share of free memory
    session_ttl_s: float = 600.0
    max_k: int = MAX_K  # largest k (drafted tokens) in one Propose or Score
    max_request_tokens: int = 8192  # tokens in one request; more is RESOURCE_EXHAUSTED
    # The scheduler's own defaults (one place; the services' flags read them from here).
    max_batch: int = BatchLimits.max_batch  # requests (sessions) per forward; 1 = batching off
    max_batch_tokens: int = BatchLimits.max_tokens  # tokens per forward (a lone larger step still runs)
    max_wait_us: int = BatchLimits.max_wait_us  # wait for company this long, only when nothing is running
    # A session's logits must not depend on who shares its forward (engine.runner).
    batch_invariant: bool = True
    stall_timeout_s: float = 120.0  # a forward running longer than this is a wedged worker
    compile: bool = False  # torch.compile the engine's norms and activation (engine.model.llama)
    # A target: prove at start-up that every position's logits are bitwise the same whatever the
    # shape of its forward (engine.selfcheck.verify_shapes), and refuse to start where not.
    require_exact: bool = False


@dataclass(frozen=True)
class Timed:
    """A plain worker call's result with where the time went (milliseconds)."""

    value: Any
    queue_ms: float
    total_ms: float


def pool_budget(limits: HostLimits, device: torch.device) -> int:
    """Bytes for the KV pool: the budget, capped on a GPU by what is free there."""
    budget = limits.cache_budget_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share = int(free * POOL_SHARE_OF_FREE_GPU)
        return share if budget is None else min(budget, share)
    return budget if budget is not None else 2 << 30


class Inexact(ValueError):
    """A target whose verify shapes are not bitwise invariant where it must be exact (engine.selfcheck)."""


def pick_runner(loaded: LoadedModel, limits: HostLimits) -> PooledRunner | StockRunner:
    """The pooled runner where batching is on and the model passes its checks; else stock.

    Raises Inexact for a target (limits.require_exact) whose speculative output could differ
    from target-only decoding: see `check_exact`.
    """
    model = loaded.model
    if loaded.feature_dim and (limits.max_batch <= 1 or unsupported(model)):
        raise ValueError(f"{loaded.name} is a feature head, which only the engine's pooled forward serves: "
                         + ("--max-batch must be above 1" if limits.max_batch <= 1 else unsupported(model)))
    if limits.max_batch <= 1:
        return check_exact(StockRunner(model), loaded, limits, "--max-batch 1")
    reason = unsupported(model)
    if reason:
        log.warning("batching off for %s: %s; serving one request per forward", loaded.name, reason)
        return check_exact(StockRunner(model), loaded, limits, reason)
    started = time.monotonic()
    forward = LlamaForward(model, compile=limits.compile)
    forward.multi_query = not limits.batch_invariant
    fixed = forward.device.type != "cpu" and limits.batch_invariant
    pool = forward.new_pool(pool_budget(limits, forward.device))
    runner = PooledRunner(forward, pool, fixed_shapes=fixed, max_rows=limits.max_batch)
    if limits.batch_invariant and not fixed:
        most_tokens = max(limits.max_batch_tokens, 64 + limits.max_k + 1)
        result = calibrate(forward.linears(), most_tokens)
        log.info("batch-invariant linears on %s (%d thread(s), %s): %s", loaded.device,
                 torch.get_num_threads(), "oneDNN" if forward.onednn else "F.linear", result.describe())
    # The checks run on a small pool of their own: the serving pool starts empty.
    checker = PooledRunner(forward, forward.new_pool(selfcheck.POOL_TOKENS * pool.block_bytes // pool.block_size),
                           fixed_shapes=fixed, max_rows=limits.max_batch)
    # Numerics against the model's own forward, with attention in the weights' dtype as the model
    # computes it (a float32 attention moves bf16 logits further from the model's than the check's
    # tolerance allows, while computing every position the same way: the verify shapes below).
    serving_attention, forward.attention_dtype = forward.attention_dtype, forward.dtype
    reason = selfcheck.numerics(checker, model, loaded.vocab_size)
    forward.attention_dtype = serving_attention
    if reason and loaded.feature_dim:
        raise ValueError(f"{loaded.name}: the engine's forward of this feature head failed its check: {reason}")
    if reason:
        log.warning("batching off for %s: %s; serving one request per forward", loaded.name, reason)
        return check_exact(StockRunner(model), loaded, limits, "the engine's forward failed its numerics check")
    if limits.batch_invariant and limits.require_exact:
        broken = selfcheck.verify_shapes(checker, loaded.vocab_size, limits.max_k)
        if broken and forward.attention_dtype != torch.float32:  # a GPU: attention in float32 instead
            log.warning("verify shapes in %s with %s attention: %s; trying float32 attention",
                        _dtype_name(forward.dtype), _dtype_name(forward.attention_dtype), broken)
            forward.attention_dtype = torch.float32
            broken = selfcheck.verify_shapes(checker, loaded.vocab_size, limits.max_k)
        if broken and forward.device.type == "cpu" and torch.get_num_threads() > 1:
            # Some CPUs' SDPA splits one query's work by the threads and the lanes beside it
            # (engine.model.attention): attention on one thread, the linears on all of them.
            log.warning("verify shapes with attention on %d threads: %s; trying attention on 1 thread",
                        torch.get_num_threads(), broken)
            forward.attention_threads = 1
            broken = selfcheck.verify_shapes(checker, loaded.vocab_size, limits.max_k)
        if broken:
            raise Inexact(f"{loaded.name} in {_dtype_name(forward.dtype)} on {loaded.device}: {broken}. "
                          "Speculative output could differ from target-only decoding, so this target does not "
                          "start; serve another --dtype (float32 is the reference), or pass "
                          "--no-batch-invariant to serve knowingly inexact")
        log.info("exactness check on %s (%s, attention in %s%s): every position's logits bitwise the same "
                 "one token at a time, in Scores of 1..%d tokens alone and packed, in a token tree and after "
                 "a chunked prefill", loaded.device, _dtype_name(forward.dtype),
                 _dtype_name(forward.attention_dtype),
                 f" on {forward.attention_threads} thread" if forward.attention_threads else "",
                 limits.max_k + 1)
    elif not limits.batch_invariant:
        log.warning("batch invariance off (--no-batch-invariant): a session's logits may differ in the last "
                    "bits with the batch and with k, so speculative output may differ from target-only's")
    for linear in forward.linears():
        if len(linear.kinds) > 1:  # not calibrated: the default kernel, unpadded
            linear.choose(linear.onednn, linear.pad_to)
        linear.source_weight = None  # calibration probes are done
    forward.release_originals()
    log.info("engine: %d-layer pooled forward, KV pool %d blocks of %d tokens (%.0f MiB), set up in %.1f s",
             forward.num_layers, pool.num_blocks - 1, pool.block_size,
             pool.num_blocks * pool.block_bytes / 2**20, time.monotonic() - started)
    return runner


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_exact(runner: StockRunner, loaded: LoadedModel, limits: HostLimits, why: str) -> StockRunner:
    """A target served through the stock forward (`why`): its verify shapes checked as the pooled
    runner's are. That forward is transformers', whose rounding changes with the token count: in
    float32 the check is reported and served on (its argmax margins have held on every prompt set
    measured); in a low-precision dtype, where they do not, the target refuses to start."""
    if not (limits.require_exact and limits.batch_invariant):
        return runner
    broken = selfcheck.verify_shapes(runner, loaded.vocab_size, limits.max_k, packed=False, trees=False)
    if not broken:
        return runner
    message = (f"{loaded.name} through the stock forward ({why}) in {_dtype_name(loaded.dtype)}: {broken}")
    if loaded.dtype != torch.float32:
        raise Inexact(message + ". Speculative output could differ from target-only decoding, so this target "
                      "does not start; serve it in float32, or pass --no-batch-invariant to serve knowingly "
                      "inexact")
    log.warning("%s; speculative output may differ from target-only's in a near tie (float32)", message)
    return runner


class ModelHost:
    """One model, its per-session KV caches and its worker thread; see the module docstring."""

    def __init__(self, loaded: LoadedModel, limits: HostLimits, *, replica_id: str = "",
                 on_fatal: Callable[[str], None] | None = None):
        self.loaded = loaded
        metrics.MODEL["name"] = loaded.name  # vLLM's model_name label (engine.metrics.KV_USAGE)
        self.limits = limits
        self.replica_id = replica_id
        self.device = loaded.device
        self.eos_ids = frozenset(loaded.eos_token_ids)
        self._on_fatal = on_fatal
        self.fatal: str | None = None
        with torch.inference_mode():
            self.runner = pick_runner(loaded, limits)
        self.caches = SessionCaches(
            self.runner.new_cache,
            max_sessions=limits.max_sessions,
            budget_bytes=limits.cache_budget_bytes if limits.cache_budget_bytes is not None else 1 << 62,
            ttl_s=limits.session_ttl_s,
        )
        self.worker = Scheduler(
            self.runner, self.caches,
            BatchLimits(max_batch=limits.max_batch, max_tokens=limits.max_batch_tokens,
                        max_wait_us=limits.max_wait_us),
            on_fatal=self._fatal,
        )
        self._watchdog = threading.Thread(target=self._watch, name="model-watchdog", daemon=True)
        self._watchdog.start()
        log.info("batching: up to %d request(s) and %d tokens per forward, %d us wait when idle",
                 self.max_batch, limits.max_batch_tokens, limits.max_wait_us)

    @property
    def max_batch(self) -> int:
        """Requests per forward actually served (1 where the model runs unbatched)."""
        return self.worker.max_batch

    def _fatal(self, reason: str) -> None:
        if self.fatal is not None:
            return
        self.fatal = reason
        log.critical("model worker unusable: %s", reason)
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def _watch(self) -> None:
        """A forward stuck past stall_timeout_s is a wedged worker (a hung kernel, a dead device)."""
        limit = self.limits.stall_timeout_s
        while self.fatal is None and limit > 0:
            time.sleep(min(1.0, limit / 4))
            started = self.worker.forward_started
            if started is not None and time.perf_counter() - started > limit:
                self._fatal(f"a forward has run for more than {limit:g} s")

    # ---- on the event loop -----------------------------------------------------

    async def serve(self, work: Work[T]) -> SessionWork[T]:
        """Run a Score or Propose on the worker, batched with whatever else is running."""
        return await self.worker.submit(work)

    async def serve_many(self, works: Sequence[Work]) -> list[SessionWork | BaseException]:
        """Several calls at once (a batch RPC): queued together, each with its own outcome."""
        return await self.worker.submit_many(works)

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

    def fork(self, source_id: str, new_id: str, length: int, prefix_hash: int, tenant: str = "") -> int:
        return self.caches.fork(source_id, new_id, length, prefix_hash, tenant).length

    def expire(self) -> int:
        return self.caches.expire()

"""ModelHost: one loaded model, its session caches, and the two verbs.

All model work runs on ONE worker thread per model (the model and its caches
are not re-entrant); the gRPC event loop only validates, queues and encodes.
Calls for different sessions therefore interleave whole-call by whole-call.

Numerics: every forward uses the model's own KV cache with explicit
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
from typing import Any, TypeVar

import torch

from specdec.core.rng import Purpose, uniform
from specdec.core.sampling import SamplingParams, probs_from_logits, sample
from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted
from specdec.hosting import metrics
from specdec.hosting.loader import LoadedModel
from specdec.hosting.sessions import Session, SessionStore

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_SESSION_ID = 256


@dataclass(frozen=True)
class HostLimits:
    max_sessions: int = 64
    cache_budget_bytes: int = 2 << 30
    session_ttl_s: float = 600.0
    max_k: int = 16  # largest k (drafted tokens) in one Propose or Score
    max_request_tokens: int = 8192  # tokens in one request; more is RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class ScoreResult:
    argmax_ids: list[int]  # [k + 1]
    probs: torch.Tensor | None  # [k + 1, vocab] on the model's device, PROBS mode only
    cache_length: int
    forward_ms: float


@dataclass(frozen=True)
class ProposeResult:
    tokens: list[int]  # drafted, 0..k of them
    probs: torch.Tensor | None  # [len(tokens), vocab], PROBS mode only
    cache_length: int
    forward_ms: float


@dataclass(frozen=True)
class Timed:
    """A worker result with where the time went (milliseconds)."""

    value: Any
    queue_ms: float
    total_ms: float


class ModelHost:
    """Serves Score and Propose for one model; see the module docstring."""

    def __init__(self, loaded: LoadedModel, limits: HostLimits, *, replica_id: str = ""):
        from transformers import DynamicCache

        self.loaded = loaded
        self.limits = limits
        self.replica_id = replica_id
        self.device = loaded.device
        self._eos = frozenset(loaded.eos_token_ids)
        config = loaded.model.config
        self.sessions = SessionStore(
            lambda: DynamicCache(config=config),
            max_sessions=limits.max_sessions,
            budget_bytes=limits.cache_budget_bytes,
            ttl_s=limits.session_ttl_s,
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    # ---- running on the worker -------------------------------------------------

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

    # ---- validation (cheap, on the event loop) ----------------------------------

    def check_request(
        self, session_id: str, cache_position: int, tokens: Sequence[int], *, min_tokens: int
    ) -> None:
        """Field checks shared by Score and Propose; raises with the field's name."""
        if not session_id:
            raise InvalidArgument("session_id must not be empty")
        if len(session_id) > MAX_SESSION_ID:
            raise InvalidArgument(f"session_id must be at most {MAX_SESSION_ID} characters")
        if len(tokens) < min_tokens:
            raise InvalidArgument(f"tokens must hold at least {min_tokens} token(s), got {len(tokens)}")
        if len(tokens) > self.limits.max_request_tokens:
            raise ResourceExhausted(
                f"tokens: {len(tokens)} tokens in one request exceeds this server's "
                f"limit of {self.limits.max_request_tokens}; send them in several calls"
            )
        vocab = self.loaded.vocab_size
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < vocab)
            raise InvalidArgument(f"tokens[{bad}] = {tokens[bad]} is outside the vocabulary [0, {vocab})")
        context = self.loaded.context_length
        if context and cache_position + len(tokens) > context:
            raise OutOfRange(
                f"cache_position + len(tokens) = {cache_position + len(tokens)} exceeds the "
                f"context length {context}"
            )

    # ---- the verbs (on the worker) ---------------------------------------------

    def _forward(self, session: Session, tokens: Sequence[int], keep: int) -> torch.Tensor:
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

    def score(
        self,
        session_id: str,
        cache_position: int,
        prefix_hash: int,
        tokens: Sequence[int],
        k: int,
        sampling: SamplingParams,
        want_probs: bool,
    ) -> ScoreResult:
        """One forward over `tokens`; results for the last k + 1 positions."""
        session = self.sessions.acquire(session_id, cache_position, prefix_hash)
        started = time.perf_counter()
        try:
            logits = self._forward(session, tokens, k + 1)  # [k + 1, vocab]
            argmax = logits.argmax(dim=-1).tolist()
            probs = probs_from_logits(logits, sampling) if want_probs else None
        except BaseException:
            self.sessions.discard(session_id)
            raise
        forward_s = time.perf_counter() - started
        metrics.FORWARD_SECONDS.labels("score").observe(forward_s)
        metrics.TOKENS_SCORED.inc(len(tokens))
        self.sessions.settle(session)
        return ScoreResult(argmax, probs, session.length, forward_s * 1e3)

    def propose(
        self,
        session_id: str,
        cache_position: int,
        prefix_hash: int,
        tokens: Sequence[int],
        k: int,
        sampling: SamplingParams,
        want_probs: bool,
        seed: int,
        p_min: float,
    ) -> ProposeResult:
        """Feed `tokens`, then draft up to k tokens autoregressively.

        Stops early before a token whose draft confidence (the top probability
        of the untransformed softmax) is below p_min, after an EOS token, and
        at the context length. The cache ends holding the committed tokens plus
        every drafted token but the last (which was sampled, never fed back):
        cache_length = cache_position + len(tokens) + max(len(drafted) - 1, 0).
        """
        session = self.sessions.acquire(session_id, cache_position, prefix_hash)
        started = time.perf_counter()
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        try:
            position = session.length + len(tokens)  # absolute position of the next token
            room = self.loaded.context_length - position if self.loaded.context_length else k
            k = max(0, min(k, room))
            logits = self._forward(session, tokens, 1)  # [1, vocab]
            for i in range(k):
                if i > 0:
                    logits = self._forward(session, drafted[-1:], 1)
                if p_min > 0.0 and torch.softmax(logits.float(), dim=-1).max().item() < p_min:
                    if drafted:
                        session.crop(session.length - 1)  # keep "all but the last" uniform
                    break
                if sampling.greedy:
                    token = int(logits.float().argmax(dim=-1).item())
                    q = probs_from_logits(logits, sampling) if want_probs else None
                else:
                    q = probs_from_logits(logits, sampling)  # [1, vocab]
                    u = torch.tensor([uniform(seed, position + i, Purpose.DRAFT)], dtype=torch.float64)
                    token = int(sample(q, u).item())
                drafted.append(token)
                if want_probs:
                    rows.append(q)
                if token in self._eos:
                    break
        except BaseException:
            self.sessions.discard(session_id)
            raise
        forward_s = time.perf_counter() - started
        metrics.FORWARD_SECONDS.labels("propose").observe(forward_s)
        metrics.TOKENS_DRAFTED.inc(len(drafted))
        metrics.TOKENS_PREFILLED.inc(len(tokens))
        self.sessions.settle(session)
        probs = None
        if want_probs:
            vocab = self.loaded.vocab_size
            probs = torch.cat(rows) if rows else torch.zeros(0, vocab, device=self.device)
        return ProposeResult(drafted, probs, session.length, forward_s * 1e3)

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)

    def expire(self) -> int:
        return self.sessions.expire()

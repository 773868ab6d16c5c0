"""The speculative decoding loop: propose, score, verify, commit — one round at a time.

`generate(spec, engine)` is an async generator of `ChunkEvent`s and a final
`Tally`. Each round:

  1. propose  one RPC to the draft service (or a local proposer): d_1..d_k, q
  2. score    one RPC to the target: one forward over the uncached committed
              tokens + d_1..d_k, returning p (or argmax) at the last k + 1 positions
  3. verify   with specdec.core.verify: accept d_1..d_m, plus one recovered/bonus token
  4. commit   cut at EOS / max_new_tokens / stop string, crop both caches'
              bookkeeping, write the session to Redis (one transaction), stream

A cache miss from either service resends every committed token from position 0
(the text cannot change: the tokens are the same). A draft service that is
down switches the request to target-only (or fails it when `strict`).

Each round is timed as a `RoundTally` (Stats.rounds): the services' compute,
the orchestrator's protobuf work, the network (the rest of the RPC time), the
time spent waiting on Redis, and the remainder. The Redis write of round i is
started at its commit and runs while round i+1 proposes and scores; round i+1
waits for it before starting its own write, and only that wait counts as its
Redis time. The write's full duration is kept apart (round i's
redis_write_ms) and is not part of any round's total.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from orchestrator.proposers import DRAFT, NONE, DraftContext, NoProposer, Proposal, Proposer, make_proposer
from orchestrator.remote import Call, ModelClient, ServiceDown
from orchestrator.routing import Router
from orchestrator.text import IncrementalDecoder
from specdec.core.fingerprint import extend, prefix_fingerprints
from specdec.core.kv import keep_lengths
from specdec.core.sampling import SamplingParams
from specdec.core.speedup import AcceptanceEstimator
from specdec.core.stopping import STOP, StopStringHoldback, clip_to_stop
from specdec.core.verify import Verdict, verify_greedy, verify_sampled
from specdec.errors import CacheMiss, NotFound, Unavailable
from specdec.store import SessionRecord, SessionStore
from specdec.v1 import common_pb2, model_pb2
from specdec.wire import decode_probs, sampling_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateSpec:
    """A validated generation request, in token ids."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int  # 0 = pick one at random (reported in the stats)
    stop: tuple[str, ...] = ()
    proposer: str = DRAFT
    k: int = 0  # 0 = the engine's default
    guess_ids: tuple[int, ...] = ()
    session_id: str = ""  # "" = a new session
    strict: bool = False


@dataclass
class Engine:
    """What the loop needs from the orchestrator process; built once at start-up."""

    store: SessionStore
    router: Router
    tokenizer: Any
    eos_ids: frozenset[int]
    context_length: int
    max_k: int = 16  # largest k both services accept
    max_check: int = 16  # largest guess Check scores in one pass (the target's limit)
    default_k: int = 5
    adaptive_k: bool = False  # k = 0 in a request: pick k per round from observed acceptance
    default_proposer: str = DRAFT
    max_new_tokens_limit: int = 4096


@dataclass(frozen=True)
class ChunkEvent:
    text: str
    token_ids: list[int]


@dataclass
class RoundTally:
    """One round's figures; becomes a Stats.Round.

    Rounds are contiguous: the first starts with the request (it carries the
    session load, routing and prompt fingerprints), each ends once its chunk
    has been handed to the stream, so draft + target + serialize + network +
    orchestrator + redis = total_ms, and the rounds add up to the request.
    """

    k: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    total_ms: float = 0.0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    serialize_ms: float = 0.0
    network_ms: float = 0.0
    orchestrator_ms: float = 0.0  # the remainder: verify, bookkeeping, detokenise, stream, failed calls
    redis_ms: float = 0.0  # waited on Redis in this round (not hidden behind RPCs)
    redis_write_ms: float = 0.0  # this round's own write, start to ack (overlaps the next round)
    bytes_sent: int = 0
    bytes_received: int = 0
    cache_misses: int = 0

    def add_call(self, call: Call | None, role: str) -> None:
        if call is None:
            return
        if role == "target":
            self.target_ms += call.server_ms
        else:
            self.draft_ms += call.server_ms
        self.serialize_ms += call.serialize_ms
        self.network_ms += call.network_ms
        self.bytes_sent += call.bytes_sent
        self.bytes_received += call.bytes_received


@dataclass
class Tally:
    """Running statistics of one generation; becomes the final Stats message."""

    session_id: str = ""
    finish_reason: str = ""
    proposer: str = ""
    fallback_reason: str = ""
    seed: int = 0
    target_replica: str = ""
    draft_replica: str = ""
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)  # per draft position: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted it
    cache_misses: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    serialize_ms: float = 0.0
    network_ms: float = 0.0
    orchestrator_ms: float = 0.0
    redis_ms: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: list[RoundTally] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def overhead_p50_ms(self) -> float:
        """Median over rounds of everything but the services' compute."""
        over = [r.total_ms - r.draft_ms - r.target_ms for r in self.rounds]
        return statistics.median(over) if over else 0.0

    def add_round(self, r: RoundTally) -> None:
        """Close a round: the running totals are the sums over rounds."""
        self.rounds.append(r)
        self.draft_ms += r.draft_ms
        self.target_ms += r.target_ms
        self.serialize_ms += r.serialize_ms
        self.network_ms += r.network_ms
        self.orchestrator_ms += r.orchestrator_ms
        self.bytes_sent += r.bytes_sent
        self.bytes_received += r.bytes_received
        self.cache_misses += r.cache_misses

    def add_verdict(self, n_drafted: int, verdict: Verdict) -> None:
        self.drafted_tokens += n_drafted
        self.accepted_tokens += verdict.accepted
        self.accepted_per_round.append(verdict.accepted)
        self.drafted_per_round.append(n_drafted)
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < verdict.accepted


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Timer:
    """Adds the elapsed milliseconds of a `with` block to an attribute of a Tally."""

    def __init__(self, tally: Tally, attr: str) -> None:
        self.tally, self.attr = tally, attr

    def __enter__(self) -> _Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ms = (time.perf_counter() - self.start) * 1e3
        setattr(self.tally, self.attr, getattr(self.tally, self.attr) + self.ms)


async def _score(
    target: ModelClient,
    session_id: str,
    tokens: list[int],
    fps: list[int],
    cached: int,
    drafted: list[int],
    sampling: SamplingParams,
) -> tuple[model_pb2.ScoreResponse, Call, int]:
    """Step 2: one target pass over tokens[cached:] + drafted; retries a cache miss from 0."""
    cached = min(cached, len(tokens) - 1)  # the target needs >= 1 committed token to score
    mode = common_pb2.OUTPUT_MODE_TOKENS if sampling.greedy else common_pb2.OUTPUT_MODE_PROBS
    misses = 0
    while True:
        request = model_pb2.ScoreRequest(
            session_id=session_id,
            cache_position=cached,
            prefix_hash=fps[cached],
            tokens=tokens[cached:] + drafted,
            k=len(drafted),
            sampling=sampling_to_proto(sampling),
            output_mode=mode,
        )
        try:
            response, call = await target.score(request)
            return response, call, misses
        except CacheMiss:
            if cached == 0:
                raise
            log.info("session %s: target cache miss at %d; resending from 0", session_id, cached)
            misses, cached = misses + 1, 0


async def _score_with_failover(
    engine: Engine,
    target: ModelClient,
    session_id: str,
    tokens: list[int],
    fps: list[int],
    cached: int,
    drafted: list[int],
    sampling: SamplingParams,
    wait_s: float = 10.0,
) -> tuple[model_pb2.ScoreResponse, Call, int, ModelClient]:
    """_score, moving to another live target replica (or waiting for this one to
    come back, up to `wait_s`) when the replica is down. A new replica holds
    nothing: the session is resent from position 0, so the text is unchanged.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            response, call, misses = await _score(target, session_id, tokens, fps, cached,
                                                  drafted, sampling)
            return response, call, misses, target
        except ServiceDown as exc:
            if time.monotonic() > deadline:
                raise
            other = await engine.router.pick("target", exclude=target.address)
            log.warning("session %s: %s; %s", session_id, exc,
                        f"moving to {other.address}" if other else "retrying")
            if other is None:
                await asyncio.sleep(0.25)
            else:
                target, cached = other, 0


async def forget_session(session_id: str, store: SessionStore, clients: Sequence[ModelClient | None]) -> None:
    """Free a session's KV on both services and drop its record (best effort)."""
    for client in clients:
        if client is not None:
            try:
                await client.release(session_id)
            except Exception as exc:  # noqa: BLE001 - cleanup must not mask the cause
                log.warning("release of %s on %s failed: %s", session_id, client.address, exc)
    try:
        await store.delete(session_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("dropping session record %s failed: %s", session_id, exc)


async def _open_session(
    spec: GenerateSpec, engine: Engine, tally: Tally
) -> tuple[SessionRecord, ModelClient, ModelClient | None, Proposer]:
    """Step 0: resume the Redis record (or start one), route to the replicas holding its KV."""
    with _Timer(tally, "redis_ms"):
        record = await engine.store.load(spec.session_id) if spec.session_id else None
    if spec.session_id and record is None:
        raise NotFound(f"session_id: unknown or expired session {spec.session_id!r}")
    record = record or SessionRecord(session_id=uuid.uuid4().hex, created=time.time())
    tally.session_id = record.session_id
    with _Timer(tally, "redis_ms"):
        target = await engine.router.pick("target", record.target)
        draft = await engine.router.pick("draft", record.draft) if spec.proposer == DRAFT else None
    if target is None:
        raise Unavailable("no target service replica is available")
    proposer: Proposer
    if spec.proposer == DRAFT and draft is None:
        if spec.strict:
            raise Unavailable("proposer: no draft service replica is available (strict)")
        proposer, tally.fallback_reason = NoProposer(), "no draft service replica available"
    else:
        proposer = make_proposer(spec.proposer, draft=draft, guess_ids=spec.guess_ids, max_k=engine.max_k)
    tally.proposer = proposer.name
    tally.target_replica = target.address
    tally.draft_replica = draft.address if draft else ""
    return record, target, draft, proposer


async def generate(spec: GenerateSpec, engine: Engine) -> AsyncIterator[ChunkEvent | Tally]:
    """Run the loop for one request: ChunkEvents as tokens commit, then the Tally."""
    started = time.perf_counter()
    tally = Tally(prompt_tokens=len(spec.prompt_ids), seed=spec.seed or secrets.randbits(63) + 1)
    store = engine.store

    record, target, draft, proposer = await _open_session(spec, engine, tally)
    session_id = record.session_id
    tokens = list(spec.prompt_ids)
    fps = prefix_fingerprints(tokens)  # fps[i] = fingerprint(tokens[:i])
    reuse = common_prefix(record.tokens, tokens)
    target_len = min(reuse, record.target_len) if target.address == record.target else 0
    draft_len = min(reuse, record.draft_len) if draft and draft.address == record.draft else 0
    tally.reused_prompt_tokens = min(target_len, len(tokens) - 1)
    k_max = spec.k or engine.default_k
    adaptive = AcceptanceEstimator() if not spec.k and engine.adaptive_k and proposer.name == DRAFT else None
    if adaptive is not None:
        k_max = engine.max_k
    decoder = IncrementalDecoder(engine.tokenizer, tokens)
    holdback = StopStringHoldback(spec.stop) if spec.stop else None
    generated = 0
    finished = False
    saving: asyncio.Future | None = None  # the previous round's Redis write

    # Round 1's clock starts with the request: it carries the set-up above.
    round_start, redis_before = started, 0.0
    try:
        while not finished:
            rnd = RoundTally()
            remaining = spec.max_new_tokens - generated
            k = min(k_max if adaptive is None else _adaptive_k(adaptive, tally, k_max),
                    remaining - 1)  # the round's extra token fills the last slot
            rnd.k = max(k, 0) if proposer.name != NONE else 0  # target-only asks for nothing

            # 1. Propose.
            proposal = Proposal(tokens=[], cache_length=draft_len)
            if k > 0:
                ctx = DraftContext(session_id, tokens, fps, len(spec.prompt_ids), k, spec.sampling,
                                   tally.seed, draft_len)
                try:
                    proposal = await proposer.propose(ctx)
                except ServiceDown as exc:
                    # This round goes on target-only; the next uses another draft
                    # replica if one is live, else the request stays target-only.
                    other = await engine.router.pick("draft", exclude=draft.address) if draft else None
                    if other is not None:
                        log.warning("session %s: %s; moving to %s", session_id, exc, other.address)
                        proposer, draft, tally.draft_replica = make_proposer(DRAFT, draft=other), other, other.address
                    elif spec.strict:
                        raise Unavailable(f"draft service down and strict is set: {exc}") from None
                    else:
                        log.warning("session %s: %s; falling back to target-only", session_id, exc)
                        proposer, tally.fallback_reason = NoProposer(), f"draft service unavailable: {exc}"
                        tally.proposer, draft = proposer.name, None
                    draft_len = 0
                    proposal = Proposal(tokens=[], cache_length=0)
            drafted = proposal.tokens[:k]
            if proposal.call is not None:
                tally.draft_calls += 1
                rnd.add_call(proposal.call, "draft")
            rnd.cache_misses += proposal.cache_misses

            # 2. Score: one target forward over the uncached tokens and the drafts.
            response, call, misses, target = await _score_with_failover(
                engine, target, session_id, tokens, fps, target_len, drafted, spec.sampling
            )
            tally.target_replica = target.address
            tally.target_passes += 1
            rnd.cache_misses += misses
            rnd.add_call(call, "target")

            # 3. Verify.
            if spec.sampling.greedy:
                verdict = verify_greedy(drafted, list(response.argmax_ids))
            else:
                q = proposal.probs[: len(drafted)] if proposal.probs is not None else None
                verdict = verify_sampled(drafted, q, decode_probs(response.probs),
                                         seed=tally.seed, position=len(tokens))
            tally.add_verdict(len(drafted), verdict)
            rnd.drafted, rnd.accepted = len(drafted), verdict.accepted
            if adaptive is not None and proposer.name == DRAFT:
                adaptive.observe(len(drafted), verdict.accepted)

            # 4. Commit: EOS / length / stop string, then cache bookkeeping, Redis, stream.
            kept, finish = clip_to_stop(verdict.tokens, eos_ids=engine.eos_ids, remaining=remaining)
            text, kept, hit = _detokenize(kept, decoder, holdback)
            if hit:
                finish = STOP
            target_len, draft_len = keep_lengths(
                committed_before=len(tokens),
                n_drafted=len(drafted),
                n_accepted=verdict.accepted,
                draft_held=proposal.cache_length,
                n_committed=len(kept),
            )
            for token in kept:
                fps.append(extend(fps[-1], token))
            tokens.extend(kept)
            generated += len(kept)
            rnd.committed = len(kept)
            tally.new_tokens = generated
            if finish:
                finished = True
                tally.finish_reason = finish
                if not hit:
                    text += _release_held(decoder, holdback)

            # The write overlaps the next round's RPCs; each round first waits for
            # the previous write, so records land in order and a failure surfaces.
            # Only that wait counts as this round's Redis time (the hidden part of
            # the write is in the previous round's redis_write_ms).
            with _Timer(tally, "redis_ms"):
                if saving is not None:
                    await saving
            record = replace(
                record, tokens=tuple(tokens), target=target.address, target_len=target_len,
                draft=draft.address if draft else record.draft,
                draft_len=draft_len if draft else record.draft_len,
                sampling=asdict(spec.sampling), seed=tally.seed, counter=record.counter + 1,
            )
            saving = asyncio.ensure_future(_timed_save(store, record, rnd))
            if finished:
                with _Timer(tally, "redis_ms"):
                    await saving
            if not tally.ttft_ms:
                tally.ttft_ms = (time.perf_counter() - started) * 1e3
            yield ChunkEvent(text=text, token_ids=kept)

            # The round ends once its chunk is on the stream; the next starts here.
            now = time.perf_counter()
            rnd.total_ms = (now - round_start) * 1e3
            rnd.redis_ms = tally.redis_ms - redis_before
            rnd.orchestrator_ms = max(0.0, rnd.total_ms - rnd.draft_ms - rnd.target_ms
                                      - rnd.serialize_ms - rnd.network_ms - rnd.redis_ms)
            tally.add_round(rnd)
            round_start, redis_before = now, tally.redis_ms
    except BaseException:
        # A client that went away (cancellation) or any failure mid-stream: the
        # session's KV must not linger on either service.
        await asyncio.shield(_abandon(saving, session_id, store, [target, draft]))
        raise
    tally.total_ms = (time.perf_counter() - started) * 1e3
    yield tally


async def _timed_save(store: SessionStore, record: SessionRecord, rnd: RoundTally) -> None:
    """store.save, noting the write's own duration on the round that made it."""
    start = time.perf_counter()
    await store.save(record)
    rnd.redis_write_ms = (time.perf_counter() - start) * 1e3


def _adaptive_k(estimator: AcceptanceEstimator, tally: Tally, k_max: int) -> int:
    """The k with the best expected speed-up at the observed acceptance and costs.

    c = a drafted token's cost relative to a target pass, both measured so far
    (server-side); at least 1, so acceptance keeps being observed.
    """
    if tally.drafted_tokens and tally.target_passes:
        c = (tally.draft_ms / tally.drafted_tokens) / max(tally.target_ms / tally.target_passes, 1e-6)
    else:
        c = 0.1  # before any measurement: a draft ~10x cheaper than the target
    return max(1, estimator.best_k(c=c, k_max=k_max))


async def _abandon(saving: asyncio.Future | None, session_id: str, store: SessionStore,
                   clients: Sequence[ModelClient | None]) -> None:
    """Let an in-flight write land (so it cannot resurrect the record), then forget the session."""
    if saving is not None:
        try:
            await saving
        except Exception:  # noqa: BLE001 - the session is being dropped anyway
            pass
    await forget_session(session_id, store, clients)


def _detokenize(
    kept: list[int], decoder: IncrementalDecoder, holdback: StopStringHoldback | None
) -> tuple[str, list[int], bool]:
    """Text for newly committed tokens; with stop strings, cut after the token completing one."""
    if holdback is None:
        return decoder.push(kept), kept, False
    text = ""
    for i, token in enumerate(kept):
        emit, hit = holdback.push(decoder.push([token]))
        text += emit
        if hit:
            return text, kept[: i + 1], True
    return text, kept, False


def _release_held(decoder: IncrementalDecoder, holdback: StopStringHoldback | None) -> str:
    """At a finish without a stop hit: the decoder's and the hold-back's remaining text."""
    tail = decoder.flush()
    if holdback is None:
        return tail
    emit, hit = holdback.push(tail)
    return emit if hit else emit + holdback.flush()


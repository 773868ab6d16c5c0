"""A session's lifecycle in the loop: open, save each round's committed state, finish or give up.

The Redis record (specdec.runtime.store.SessionRecord) is the last committed state:
the committed token ids, per role the replica holding the session's KV and
how many of those tokens it holds, and where the current turn started and
its seed. A turn resumes from it on any orchestrator replica.

Writes go through one `RecordWriter` per session: only the latest state
needs to land, so pending states coalesce, and a write that fails (Redis
down, frozen or restarting) is retried with backoff while the stream keeps
going from the loop's in-memory state. Each round waits briefly for the
previous write (records land in order and lag the stream by about a round).
A stream gives up with UNAVAILABLE only once Redis has failed for longer than
the outage bound (`--redis-outage-s`); the writer then goes on in the
background, for a bounded time, so the committed prefix lands as soon as
Redis is back.

A failed turn never deletes the record: cancellation, a timeout or an outage
leave the last committed state for the next turn or a retry. Only EndSession
and the TTL delete a kept session; a single-turn one (keep_session unset) is
deleted when its stream finishes.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar


from orchestrator.fleet.remote import ModelClient, SessionReplica, in_background, release_kv
from orchestrator.config import LoopConfig, RecordStore
from orchestrator.common.request import TurnRequest
from orchestrator.common.stats import RoundTally, Tally, Timer
from specdec.core.kv import common_prefix
from specdec.runtime import tracing
from specdec.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from specdec.runtime.store import SessionRecord, StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

WRITE_WAIT_S = 0.25  # longest a round waits for the previous write before going on without it
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 0.25  # backoff between attempts while Redis fails
# On top of the bound: the outage is seen at the first failed attempt and ends at
# the first one after Redis answers again (its own start-up included).
OUTAGE_GRACE_S = 0.5
_DELETE = object()  # a pending "delete the record" in place of a state
_WRITERS: dict[str, RecordWriter] = {}  # per session id: this process's one writer


def outage_error(bound_s: float, what: str) -> Unavailable:
    return Unavailable(f"redis (the session store) unavailable for more than {bound_s:g} s ({what}); "
                       "the session's committed tokens are saved once it answers")


class RecordWriter:
    """Lands a session's latest record in Redis, retrying through outages.

    `submit` replaces whatever state is still pending (only the latest needs to
    land); one task writes, so states land in order. A failed attempt is
    retried with backoff until `give_up_s` after the outage began.
    """

    def __init__(self, store: RecordStore, session_id: str, *, give_up_s: float) -> None:
        self.store, self.session_id, self.give_up_s = store, session_id, give_up_s
        self._pending: object = None  # a SessionRecord, _DELETE, or None
        self._rnd: RoundTally | None = None  # the round whose state is pending (its write time)
        self._task: asyncio.Task | None = None
        self._since: float | None = None  # start of the first attempt not yet followed by a success
        self.failing = False  # the last attempt failed (Redis down): nobody waits for the retry
        self.last_error = ""

    @classmethod
    def for_session(cls, store: RecordStore, session_id: str, *, give_up_s: float) -> RecordWriter:
        """The process's writer for `session_id`: a failed turn's, still retrying, is adopted
        (so its older state can never land after this turn's)."""
        writer = _WRITERS.get(session_id)
        if writer is None or writer.store is not store or not writer._same_loop():
            writer = _WRITERS[session_id] = cls(store, session_id, give_up_s=give_up_s)
        return writer

    def _same_loop(self) -> bool:
        return self._task is None or self._task.get_loop() is asyncio.get_running_loop()

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def outage_s(self) -> float:
        """How long the oldest unlanded state has been waiting on Redis (0 when all landed)."""
        return time.monotonic() - self._since if self._since is not None and self.busy else 0.0

    def submit(self, state: SessionRecord, rnd: RoundTally | None = None) -> None:
        self._pending, self._rnd = state, rnd
        self._start()

    def submit_delete(self) -> None:
        self._pending, self._rnd = _DELETE, None
        self._start()

    def cancel(self) -> None:
        """Drop whatever is pending (the session is being forgotten)."""
        self._pending = None
        if self.busy:
            self._task.cancel()

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every submitted state to land; True when it has."""
        if self.busy:
            await asyncio.wait({self._task}, timeout=max(0.0, timeout_s))  # never cancels the write
        return not self.busy

    def _start(self) -> None:
        if not self.busy:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        delay = RETRY_FIRST_S
        try:
            while self._pending is not None:
                state, rnd = self._pending, self._rnd
                self._pending = None
                start = time.perf_counter()
                self._since = self._since or time.monotonic()
                try:
                    if state is _DELETE:
                        await self.store.delete(self.session_id)
                    else:
                        await self.store.save(state)
                except StoreUnavailable as exc:
                    if self._pending is None:  # nothing newer: this state is still the latest
                        self._pending, self._rnd = state, rnd
                    self.failing, self.last_error = True, str(exc)
                    if time.monotonic() - self._since > self.give_up_s:
                        log.error("session %s: record not saved, redis failing for %.0f s: %s",
                                  self.session_id, self.give_up_s, exc)
                        self._pending = None
                        return
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
                    continue
                end = time.perf_counter()
                if self._since is not None and time.monotonic() - self._since > 1.0:
                    log.info("session %s: record saved after a redis outage of %.1f s",
                             self.session_id, time.monotonic() - self._since)
                self._since, self.failing, delay = None, False, RETRY_FIRST_S
                if rnd is not None:
                    rnd.redis_write_ms = (end - start) * 1e3
                # under the commit span of the round that submitted it (tracing on)
                tracing.interval("redis write", start, end, round_state=rnd is not None)
        finally:
            if self._pending is None and _WRITERS.get(self.session_id) is self:
                del _WRITERS[self.session_id]


class Session:
    """One request's hold on a session: its record, the target replica, its record writer."""

    def __init__(self, config: LoopConfig, record: SessionRecord, target: SessionReplica,
                 reuse: int, tally: Tally, prefix: Sequence[int] = ()) -> None:
        self.store, self.record, self.target, self.tally = config.store, record, target, tally
        self.prefix = tuple(prefix)  # the turn's committed tokens at its start: prompt (+ delivered)
        self.outage_bound_s = config.redis_outage_s
        self.reuse = reuse  # leading prompt tokens equal to the record's committed tokens
        self.writer = RecordWriter.for_session(config.store, record.session_id,
                                               give_up_s=config.redis_retry_s)
        self.record_interval_s = config.record_interval_s
        self._submitted = 0.0  # time.monotonic() of the last state handed to the writer
        self._unsaved = False  # a round's state is newer than the last one handed to the writer
        # The last save's state, not yet made a record: (tokens, their count, target, its length,
        # draft or None, its length); _submit builds the record from it.
        self._state: tuple | None = None

    @property
    def id(self) -> str:
        return self.record.session_id

    @property
    def multi_turn(self) -> bool:
        return self.record.multi_turn

    def draft_home(self) -> tuple[str, int]:
        """The draft replica the record names and how many of this prompt's tokens it holds."""
        return self.record.draft, min(self.reuse, self.record.draft_len)

    def _check_outage(self, what: str) -> None:
        if self.writer.outage_s > self.outage_bound_s + OUTAGE_GRACE_S:
            log.warning("session %s: giving up the stream: %s", self.id, self.writer.last_error)
            raise outage_error(self.outage_bound_s, what)

    async def save(self, tokens: Sequence[int], draft: SessionReplica | None, rnd: RoundTally,
                   *, last: bool) -> None:
        """Record the committed state after a round; the write overlaps the next round.

        The round first waits for the previous write, but not past WRITE_WAIT_S
        of it, nor once an attempt has failed: while Redis is slow or down the
        stream goes on and the writer keeps only the latest state. Only that wait counts as this round's Redis
        time (the write's own duration is its round's redis_write_ms). Without a
        draft replica the record keeps its draft fields, so a later turn with a
        draft can still reuse that KV.
        """
        now = time.monotonic()
        write = last or now - self._submitted >= self.record_interval_s
        if write:
            with Timer(self.tally, "redis_ms"):
                if self.writer.busy and not self.writer.failing:
                    await self.writer.wait(WRITE_WAIT_S - self.writer.outage_s)
        self._check_outage("session save")
        # The state as of this round; the record itself is built only when it is written (the
        # committed tokens only grow within a turn, so their count stands for them).
        self._state = (tokens, len(tokens), self.target.address, self.target.held,
                       draft.address if draft else None, draft.held if draft else 0)
        self.tally.target_replica = self.target.address
        if draft is not None:
            self.tally.draft_replica = draft.address
        if not write:
            self._unsaved = True
            return
        self._submit(rnd)
        if last:
            with Timer(self.tally, "redis_ms"):
                await self._finish(draft)

    def _submit(self, rnd: RoundTally | None = None) -> None:
        if self._state is not None:
            tokens, n, target, target_len, draft, draft_len = self._state
            self._state = None
            self.record = replace(
                self.record, tokens=tuple(tokens[:n]), target=target, target_len=target_len,
                draft=draft if draft is not None else self.record.draft,
                draft_len=draft_len if draft is not None else self.record.draft_len,
            )
        self.writer.submit(self.record, rnd)
        self._submitted, self._unsaved = time.monotonic(), False

    def _leave(self, draft: SessionReplica | None) -> None:
        """No more calls this turn: the replicas' batch calls stop counting on this session."""
        for replica in (self.target, draft):
            if replica is not None:
                replica.client.leave(self.id)

    async def _finish(self, draft: SessionReplica | None) -> None:
        """A kept session's last state must land (within the outage bound) before the turn ends;
        a single-turn session's record is deleted and its KV released (neither waits on a fault)."""
        self._leave(draft)
        if self.multi_turn:
            while not await self.writer.wait(0.05):
                self._check_outage("session save")
            return
        self.writer.submit_delete()
        await self.writer.wait(WRITE_WAIT_S)  # else it lands in the background
        in_background(release_kv(self.id, [self.target.client, draft.client if draft else None]))

    async def abandon(self, draft: SessionReplica | None) -> None:
        """After a failed or cancelled turn: keep the record (the writer lands the last state,
        in the background if Redis is down). A single-turn session's KV is released: only a
        resume comes back to it, and that resends."""
        self._leave(draft)
        if self._unsaved:
            self._submit()  # the rounds since the last write
        if not self.multi_turn:  # in the background: a hung replica must not hold the error back
            in_background(release_kv(self.id, [self.target.client, draft.client if draft else None]))


async def retry_redis(fetch: Callable[[], Awaitable[T]], bound_s: float, what: str) -> T:
    """`fetch()`, retried with backoff while Redis is unavailable, for up to the outage bound."""
    deadline = time.monotonic() + bound_s + OUTAGE_GRACE_S
    delay = RETRY_FIRST_S
    while True:
        try:
            return await fetch()
        except StoreUnavailable as exc:
            if time.monotonic() + delay > deadline:
                log.warning("%s: %s", what, exc)
                raise outage_error(bound_s, what) from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)


def _turn_seed(req: TurnRequest, record: SessionRecord | None) -> int:
    """The request's seed; for a resume with seed 0, the one the record kept for this turn, else a
    new one: the rounds continue from the delivered tokens, so any seed samples them exactly."""
    if req.seed:
        return req.seed
    if req.resume_from and record is not None and record.turn_start == len(req.prompt_ids) and record.turn_seed:
        return record.turn_seed
    return secrets.randbits(63) + 1


def _delivered(req: TurnRequest, record: SessionRecord | None) -> tuple[int, ...]:
    """A resume's delivered tokens, checked against the session record of the same turn.

    An older client sends none: the record's committed tokens stand for them,
    since each is saved before its chunk is streamed; the record may lag the
    stream by a round (`record_interval_s`), and then the client must send them.
    """
    if not req.resume_from:
        return req.delivered or ()
    turn = record is not None and record.turn_start == len(req.prompt_ids) and \
        tuple(record.tokens[:len(req.prompt_ids)]) == req.prompt_ids
    kept = tuple(record.tokens[len(req.prompt_ids):]) if turn else ()
    if req.delivered is None:
        wanted = req.resume_from - len(req.prompt_ids)
        if len(kept) < wanted:
            raise FailedPrecondition(
                f"delivered: the session record holds {len(kept)} of the {wanted} tokens this stream "
                "delivered; resend the request with GenerateRequest.delivered (the client library does)")
        return kept[:wanted]
    n = min(len(kept), len(req.delivered))
    if kept[:n] != req.delivered[:n]:
        raise FailedPrecondition("delivered: the tokens differ from the ones this turn committed (session "
                                 "record); resume with the tokens the stream delivered")
    return req.delivered


async def open_session(req: TurnRequest, config: LoopConfig, tally: Tally) -> Session:
    """Resume the Redis record (or start one) and route the target to the replica holding its KV.

    The stream holds a slot on that replica (config.admission) until the
    caller calls `config.admission.leave(session.target)`.

    The turn's start and seed go into the record first (the write overlaps
    routing and round 1, which waits for it): a resume after this
    orchestrator dies draws with the same seed. A resume starts from the
    prompt and the delivered tokens (`Session.prefix`).
    """
    if req.resume_from and req.resume_from < len(req.prompt_ids):
        raise InvalidArgument(f"resume_from: {req.resume_from} is before the turn's first generated "
                              f"token (index {len(req.prompt_ids)})")
    record = None
    if req.session_id:
        with Timer(tally, "redis_ms"):
            record = await retry_redis(lambda: config.store.load(req.session_id),
                                       config.redis_outage_s, "session load")
    foreign = record is not None and record.tenant != req.tenant
    if foreign:
        record = None  # another tenant's session: as if the id were unknown, and never overwritten
    if req.session_id and record is None and (foreign or not req.resume_from):
        raise NotFound(f"session_id: unknown or expired session {req.session_id!r}")
    seed = tally.seed = _turn_seed(req, record)
    prefix = req.prompt_ids + _delivered(req, record)
    # A resume whose record is gone (a single-turn stream that had finished) continues without it.
    record = record or SessionRecord(session_id=req.session_id or uuid.uuid4().hex,
                                     created=time.time(), tenant=req.tenant)
    record = replace(record, turn_start=len(req.prompt_ids), turn_seed=seed,
                     multi_turn=record.multi_turn or req.keep_session)
    tally.session_id = record.session_id
    reuse = common_prefix(record.tokens, prefix)
    with Timer(tally, "redis_ms"):  # admission: a replica with room, else RESOURCE_EXHAUSTED
        target = await config.admission.place(config.router, record.session_id, record.target,
                                              min(reuse, record.target_len), wait_s=config.target_wait_s,
                                              tenant=req.tenant)
    if target is None:
        raise Unavailable("no target service replica is available")
    tally.target_replica = target.address
    tally.reused_prompt_tokens = min(target.held, len(req.prompt_ids) - 1)
    session = Session(config, record, target, reuse, tally, prefix)
    session.writer.submit(record)
    return session


async def forget_session(session_id: str, store: RecordStore, clients: Sequence[ModelClient | None]) -> None:
    """Free a session's KV on both services and drop its record (best effort)."""
    writer = _WRITERS.pop(session_id, None)
    if writer is not None:
        writer.cancel()  # a write still retrying must not bring the record back
    await release_kv(session_id, clients)
    try:
        await store.delete(session_id)
    except Exception as exc:  # noqa: BLE001
        log.warning("dropping session record %s failed: %s", session_id, exc)

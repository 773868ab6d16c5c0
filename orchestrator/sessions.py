"""A session's lifecycle in the loop: open, save each round's committed state, forget, abandon.

The Redis record (specdec.store.SessionRecord) is the last committed state:
the committed token ids and, per role, the replica holding the session's KV
and how many of those tokens it holds. A turn resumes from it on any
orchestrator replica. Each round's write overlaps the next round's RPCs; the
next save (or the end of the request) first waits for it, so records land in
order and a failed write surfaces.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from orchestrator.remote import ModelClient, SessionReplica, place
from orchestrator.spec import GenerateSpec, LoopConfig, RecordStore
from orchestrator.stats import RoundTally, Tally, Timer
from specdec import tracing
from specdec.errors import NotFound, Unavailable
from specdec.store import SessionRecord

log = logging.getLogger(__name__)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    """One request's hold on a session: its record, the target replica, the write in flight."""

    def __init__(self, store: RecordStore, record: SessionRecord, target: SessionReplica,
                 reuse: int, tally: Tally) -> None:
        self.store, self.record, self.target, self.tally = store, record, target, tally
        self.reuse = reuse  # leading prompt tokens equal to the record's committed tokens
        self._saving: asyncio.Future | None = None  # the previous round's write

    @property
    def id(self) -> str:
        return self.record.session_id

    def draft_home(self) -> tuple[str, int]:
        """The draft replica the record names and how many of this prompt's tokens it holds."""
        return self.record.draft, min(self.reuse, self.record.draft_len)

    async def save(self, tokens: Sequence[int], draft: SessionReplica | None, rnd: RoundTally,
                   *, last: bool) -> None:
        """Record the committed state after a round; the write overlaps the next round.

        Only the wait for the previous write counts as this round's Redis time
        (the hidden part is in that round's redis_write_ms); the last round also
        waits for its own. Without a draft replica the record keeps its draft
        fields, so a later turn with a draft can still reuse that KV.
        """
        with Timer(self.tally, "redis_ms"):
            if self._saving is not None:
                await self._saving
        self.record = replace(
            self.record, tokens=tuple(tokens), target=self.target.address, target_len=self.target.cached,
            draft=draft.address if draft else self.record.draft,
            draft_len=draft.cached if draft else self.record.draft_len,
        )
        self.tally.target_replica = self.target.address
        if draft is not None:
            self.tally.draft_replica = draft.address
        self._saving = asyncio.ensure_future(_timed_save(self.store, self.record, rnd))
        if last:
            with Timer(self.tally, "redis_ms"):
                await self._saving

    async def abandon(self, draft: SessionReplica | None) -> None:
        """Let an in-flight write land (so it cannot resurrect the record), then forget the session."""
        if self._saving is not None:
            try:
                await self._saving
            except Exception:  # noqa: BLE001 - the session is being dropped anyway
                pass
        clients = [self.target.client, draft.client if draft else None]
        await forget_session(self.id, self.store, clients)


async def open_session(spec: GenerateSpec, config: LoopConfig, tally: Tally) -> Session:
    """Resume the Redis record (or start one) and route the target to the replica holding its KV."""
    with Timer(tally, "redis_ms"):
        record = await config.store.load(spec.session_id) if spec.session_id else None
    if record is not None and record.tenant != spec.tenant:
        record = None  # another tenant's session: exactly as if the id were unknown
    if spec.session_id and record is None:
        raise NotFound(f"session_id: unknown or expired session {spec.session_id!r}")
    record = record or SessionRecord(session_id=uuid.uuid4().hex, created=time.time(),
                                     tenant=spec.tenant)
    tally.session_id = record.session_id
    reuse = common_prefix(record.tokens, spec.prompt_ids)
    with Timer(tally, "redis_ms"):
        target = await place(config.router, "target", record.session_id, record.target,
                             min(reuse, record.target_len))
    if target is None:
        raise Unavailable("no target service replica is available")
    tally.target_replica = target.address
    tally.reused_prompt_tokens = min(target.cached, len(spec.prompt_ids) - 1)
    return Session(config.store, record, target, reuse, tally)


async def forget_session(session_id: str, store: RecordStore, clients: Sequence[ModelClient | None]) -> None:
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


async def _timed_save(store: RecordStore, record: SessionRecord, rnd: RoundTally) -> None:
    """store.save, noting the write's own duration on the round that made it."""
    start = time.perf_counter()
    await store.save(record)
    end = time.perf_counter()
    rnd.redis_write_ms = (end - start) * 1e3
    tracing.interval("redis write", start, end, round_state=True)  # under the round's commit span (tracing on)

"""Stored responses (/v1/responses with `store`): each the gateway's record of a kept session.

A stored response's conversation is a kept orchestrator session (Redis: its committed tokens,
which replicas hold its KV, its tenant, its TTL); the record here holds what the session does
not: the conversation as messages (sent whole again on the next turn, whose shared token
prefix the services then serve from their KV caches) and the Response object for
GET /v1/responses/{id}. A chain of responses (`previous_response_id`) continues one session,
so several records may name it; DELETE ends the session when the last of them goes.

Records are the caller's: the owner is a digest of the Authorization header, the token the
orchestrator derives the tenant from, so another caller's id is as unknown as a made-up one
(and its session is refused by the orchestrator too). They expire --responses-ttl after their
last use (the orchestrator's --record-ttl by default) and at most --max-stored-responses are
held, the least recently used going first. They live in this gateway process: replicas of the
gateway behind one address need sticky routing by caller for `previous_response_id`.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The orchestrator's --record-ttl default (specdec.runtime.store.SESSION_TTL_S, not imported: the
# gateway does not import redis), so a record and its session expire together by default.
RECORD_TTL_S = 3600


def owner(authorization: str | None) -> str:
    """Whose records these are: a digest of the caller's Authorization header ("" without one)."""
    return hashlib.sha256(authorization.encode()).hexdigest() if authorization else ""


@dataclass
class StoredResponse:
    id: str
    owner: str
    body: dict[str, Any]  # the Response object, as returned
    history: list[dict[str, Any]]  # the chat messages so far, this response's output included
    session_id: str  # the orchestrator's kept session ("" where it kept none)
    expires: float = field(default=0.0)


class ResponseStore:
    """Records by id, each visible to its owner only, expiring `ttl_s` after their last use."""

    def __init__(self, ttl_s: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.capacity, self.clock = ttl_s, capacity, clock
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, record: StoredResponse) -> None:
        if self.capacity < 1:
            return
        record.expires = self.clock() + self.ttl_s
        self._records[record.id] = record
        self._records.move_to_end(record.id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, ident: str, who: str) -> StoredResponse | None:
        """The owner's live record (used: its expiry moves on), else None."""
        record = self._records.get(ident)
        if record is None or record.owner != who:
            return None
        now = self.clock()
        if record.expires <= now:
            del self._records[ident]
            return None
        record.expires = now + self.ttl_s
        self._records.move_to_end(ident)
        return record

    def delete(self, ident: str, who: str) -> StoredResponse | None:
        record = self.get(ident, who)
        if record is not None:
            del self._records[ident]
        return record

    def names_session(self, session_id: str) -> bool:
        """Whether a live record still continues `session_id`."""
        now = self.clock()
        return any(r.session_id == session_id and r.expires > now for r in self._records.values())

"""Per-session KV caches with prefix fingerprints, LRU eviction and an idle TTL.

Not thread-safe on purpose: a ModelHost touches its SessionCaches only from its
single model-worker thread (engine.scheduler), between forwards.

A session's cache is an `engine.pool.SessionKV` (its blocks of the KV pool) or
an `engine.stock.DynamicKV` (one request per forward); both crop to an absolute
length, free what they hold, and report their bytes. Dropping a session for any
reason (release, eviction, TTL, a failed forward) frees its blocks at once.

Eviction is fair between tenants (ScoreRequest.tenant): under the session
count, the byte budget or the pool's pressure, the victim is the least
recently used idle session of the tenant holding the most (sessions for the
count, bytes otherwise), so a tenant's flood of sessions evicts its own first.
With one tenant this is plain LRU.

Cache check (the contract in proto/specdec/v1/model.proto): a session holding
n tokens keeps fingerprints[i] = fingerprint(tokens[:i]) for i in 0..n. A
request (cache_position=c, prefix_hash=h) is served only if c <= n and
fingerprints[c] == h; otherwise it is a CacheMiss and nothing changes.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.core import fingerprint as fp
from specdec.runtime.errors import CacheMiss
from engine import metrics
from engine.tree import PendingTree

log = logging.getLogger(__name__)


@dataclass
class CachedSession:
    """One session's KV cache and the fingerprints of the tokens it holds."""

    session_id: str
    cache: Any  # SessionKV or DynamicKV: length, reserve, crop(length), free, nbytes
    fingerprints: list[int] = field(default_factory=lambda: [fp.EMPTY])
    last_used: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    pins: int = 0  # calls running on it: never evicted, freed only once the last one ends
    dropped: bool = False  # forgotten while pinned: free it at the last unpin
    tenant: str = ""  # whose session it is (the request's tenant): eviction is fair between them
    # A feature head's own normed hidden state at position tail_length - 1 (its
    # predicted target feature there); valid while the session holds tail_length tokens.
    tail: Any = None
    tail_length: int = -1
    tree: PendingTree | None = None  # fed token-tree nodes above the held prefix (engine.tree)

    @property
    def length(self) -> int:
        """Tokens held (the cache contract's length)."""
        return len(self.fingerprints) - 1

    @property
    def stored(self) -> int:
        """Positions the KV cache fills: the held tokens, then a pending tree's nodes."""
        return self.length + (len(self.tree.tokens) if self.tree is not None else 0)

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (absolute, so a retry is idempotent); a pending tree goes."""
        if self.tree is not None:
            self.tree = None
            self.cache.crop(self.length)
        if length < self.length:
            self.cache.crop(length)
            del self.fingerprints[length + 1 :]
        if length < self.tail_length:
            self.tail, self.tail_length = None, -1

    def append(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> None:
        """Record tokens the cache has just been extended with; with `parents`, its last
        len(parents) tokens are tree nodes, pending above the held prefix."""
        chain = len(tokens) - len(parents) if parents else len(tokens)
        if chain and self.tree is not None:  # acquire takes up or drops a tree before anything is fed
            raise RuntimeError("tokens fed after a pending tree's nodes")
        for token in tokens[:chain]:
            self.fingerprints.append(fp.extend(self.fingerprints[-1], token))
        if parents:
            if self.tree is None:
                self.tree = PendingTree(self.length, self.fingerprints[-1])
            self.tree.add(tokens[chain:], parents)

    def take_path(self, cache_position: int, prefix_hash: int) -> bool:
        """Hold the pending tree's path named by (cache_position, prefix_hash), if it has one: its
        K/V moves into place after the prefix (engine.tree)."""
        if self.tree is None or cache_position <= self.length:
            return False
        path = self.tree.find(cache_position - self.length, prefix_hash)
        if path is None:
            return False
        tree = self.tree
        self.cache.move([tree.base + node for node in path], tree.base)
        self.tree = None
        self.cache.crop(tree.base + len(path))
        self.append([tree.tokens[node] for node in path])
        return True


class SessionCaches:
    """LRU map session id -> CachedSession under a session count and a byte budget."""

    def __init__(
        self,
        new_cache: Callable[[], Any],
        *,
        max_sessions: int,
        budget_bytes: int,
        ttl_s: float,
    ):
        self._new_cache = new_cache
        self.max_sessions = max_sessions
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[str, CachedSession] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def nbytes(self) -> int:
        return self._bytes  # the sum of the sessions' last measured nbytes, kept as they change

    def acquire(self, session_id: str, cache_position: int, prefix_hash: int,
                tenant: str = "") -> CachedSession:
        """The session, cropped to `cache_position` after the cache check.

        cache_position 0 always succeeds (a fresh start; prefix_hash is ignored
        since the empty prefix is always held). Raises CacheMiss otherwise.
        """
        session = self._sessions.get(session_id)
        if cache_position == 0:
            if session is None:
                self._make_room(tenant)
                session = CachedSession(session_id, self._new_cache(), tenant=tenant)
                self._sessions[session_id] = session
            else:
                session.crop(0)  # a fresh start: everything it held goes back at once
                session.fingerprints = [fp.EMPTY]
        elif session is None:
            metrics.CACHE_MISSES.labels("unknown_session").inc()
            raise CacheMiss(
                f"session {session_id!r} holds nothing here (new, released, evicted, "
                f"or the service restarted); resend all tokens with cache_position=0"
            )
        elif cache_position > session.length and session.take_path(cache_position, prefix_hash):
            metrics.CACHE_HITS.inc()  # a tree's path taken up
        elif cache_position > session.length:
            metrics.CACHE_MISSES.labels("beyond_held").inc()
            # Never the held length in the message: it would tell any caller how
            # long another session is. The server log has it.
            raise CacheMiss(f"cache_position {cache_position} is not held for this session",
                            detail=f"session {session_id!r} holds {session.length} tokens")
        elif session.fingerprints[cache_position] != prefix_hash:
            metrics.CACHE_MISSES.labels("prefix_mismatch").inc()
            raise CacheMiss(f"prefix_hash does not match the first {cache_position} tokens "
                            "held for this session")
        else:
            session.crop(cache_position)
            metrics.CACHE_HITS.inc()
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session

    def fork(self, source_id: str, new_id: str, length: int, prefix_hash: int,
             tenant: str = "") -> CachedSession:
        """A new session `new_id` holding a copy of `source_id`'s first `length` tokens.

        The source is checked as a call's cache_position would be (CacheMiss when
        it does not hold exactly that prefix); a session already named `new_id`
        is replaced.
        """
        source = self.acquire_view(source_id, length, prefix_hash)
        self._forget(new_id)
        tenant = tenant or source.tenant
        self._make_room(tenant)
        session = CachedSession(new_id, self._new_cache(), tenant=tenant)
        session.cache.copy_prefix(source.cache, length)
        session.fingerprints = source.fingerprints[: length + 1]
        self._sessions[new_id] = session
        self.settle(session)
        return session

    def acquire_view(self, session_id: str, length: int, prefix_hash: int) -> CachedSession:
        """The session if it holds `length` tokens with this fingerprint (nothing cropped)."""
        session = self._sessions.get(session_id)
        if session is None or length > session.length:
            metrics.CACHE_MISSES.labels("unknown_session" if session is None else "beyond_held").inc()
            raise CacheMiss(f"fork: session {session_id!r} does not hold {length} tokens here")
        if session.fingerprints[length] != prefix_hash:
            metrics.CACHE_MISSES.labels("prefix_mismatch").inc()
            raise CacheMiss("fork: prefix_hash does not match the source session's first "
                            f"{length} tokens")
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session

    def settle(self, session: CachedSession) -> None:
        """After a call: re-measure the session and enforce the byte budget."""
        measured = session.cache.nbytes
        if self._sessions.get(session.session_id) is session:
            self._bytes += measured - session.nbytes
        session.nbytes = measured
        # The session just served stays, even alone over budget; running ones too.
        while self.nbytes > self.budget_bytes:
            victim = self._victim({session.session_id}, by_bytes=True)
            if victim is None:
                break
            self._drop(victim, "budget")
        # A session admitted while every other one was running went over the count: back to it.
        while len(self._sessions) > self.max_sessions:
            victim = self._victim({session.session_id}, by_bytes=False)
            if victim is None:
                break
            self._drop(victim, "max_sessions")
        self._publish()

    def pin(self, session: CachedSession) -> None:
        """A call starts running on `session`: it stays (its blocks stay) until `unpin`."""
        session.pins += 1

    def unpin(self, session: CachedSession) -> None:
        session.pins -= 1
        if session.pins == 0 and session.dropped:
            session.cache.free()

    def release(self, session_id: str) -> bool:
        found = self._forget(session_id)
        self._publish()
        return found

    def discard(self, session: CachedSession) -> None:
        """Forget a session whose cache may be inconsistent (a failed forward)."""
        if self._sessions.get(session.session_id) is session:
            self._forget(session.session_id)
        self._publish()

    def evict_idle(self, busy: set[str], reason: str) -> bool:
        """Drop an idle session not in `busy` (in a running forward), the heaviest tenant's least
        recently used (`_victim`, by bytes); False if there is none."""
        victim = self._victim(busy, by_bytes=True)
        if victim is None:
            return False
        self._drop(victim, reason)
        self._publish()
        return True

    def _forget(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._bytes -= session.nbytes
        if session.pins:
            session.dropped = True  # a running call still uses its blocks
        else:
            session.cache.free()
        return True

    def expire(self, now: float | None = None) -> int:
        """Drop sessions idle longer than the TTL; return how many."""
        now = time.monotonic() if now is None else now
        idle = [s.session_id for s in self._sessions.values()
                if now - s.last_used > self.ttl_s and not s.pins]
        for session_id in idle:
            self._drop(session_id, "ttl")
        if idle:
            self._publish()
        return len(idle)

    def _make_room(self, tenant: str) -> None:
        """Room under the count for a new session of `tenant` (which counts as already held)."""
        while len(self._sessions) >= self.max_sessions:
            victim = self._victim((), by_bytes=False, newcomer=tenant)
            if victim is None:
                return  # every session is running: over the count until one finishes
            self._drop(victim, "max_sessions")

    def _victim(self, spare: Collection[str], *, by_bytes: bool, newcomer: str | None = None) -> str | None:
        """The least recently used idle session (not pinned, not in `spare`) of the tenant that
        holds the most, in bytes or in sessions (a `newcomer` tenant's session about to be made
        counts); among tenants holding as much, the least recently used. None if none is idle."""
        held: dict[str, int] = {} if newcomer is None else {newcomer: 1}
        for s in self._sessions.values():
            held[s.tenant] = held.get(s.tenant, 0) + (s.nbytes if by_bytes else 1)
        best: CachedSession | None = None
        for s in self._sessions.values():  # least recently used first
            if not s.pins and s.session_id not in spare and (best is None or held[s.tenant] > held[best.tenant]):
                best = s
        return best.session_id if best is not None else None

    def _drop(self, session_id: str, reason: str) -> None:
        self._forget(session_id)
        metrics.EVICTIONS.labels(reason).inc()
        log.info("evicted session %r (%s)", session_id, reason)

    def _publish(self) -> None:
        metrics.ACTIVE_SESSIONS.set(len(self._sessions))
        metrics.CACHE_BYTES.set(self.nbytes)
        metrics.kv_usage(self.nbytes, self.budget_bytes)

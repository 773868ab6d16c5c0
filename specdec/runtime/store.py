"""Redis-backed session handles and service registry (the only module importing redis).

Redis holds handles, never tensors: per session, the committed token ids and
which target/draft replica holds its KV cache and at what length, plus where
the current turn started and its seed (a request with seed 0 gets a random
one; a resumed turn must draw the same numbers). Sampling parameters are not
kept: each request carries its own. Each write stores the whole record
atomically (one script call for all the saves of an event-loop turn: `SAVE_SCRIPT`),
so any orchestrator replica can resume a session from Redis alone and never sees a
half-written round. A kept session (multi-turn)
lives for the session TTL after its last write; a single-turn one only for a
short TTL (it is deleted when its stream finishes, the TTL covers a stream
that never finishes). Kept sessions are also counted per tenant (`kept`: a
sorted set per tenant, each session scored with its record's expiry), so the
orchestrator can cap them (--max-kept-sessions-per-tenant).

Every key carries a TTL (records, registry entries, the registry index, the
kept-session sets): a Redis with `maxmemory-policy volatile-lru` (the
generated redis.conf, specdec.runtime.credentials) evicts the least recently
used, which are idle sessions' records; the registry is rewritten every
heartbeat and read by every request (docs/operations.md, "Redis memory").

Services register (address, role, model, tokenizer fingerprint, load) under a
key with a TTL that a heartbeat refreshes; a replica that stops beating drops
out of `ServiceRegistry.live` within one TTL. The registry is not trusted
blindly: `live` ignores (with one log line each) entries that do not parse,
and, given what the orchestrator `Expected`, entries without its tokenizer
fingerprint or serving another model than the role's; unknown fields are
ignored, not an error.

Every Redis failure becomes `StoreUnavailable` after short socket timeouts, so
a dead Redis is a quick UNAVAILABLE, never a hang.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from specdec.runtime.errors import Unavailable
from specdec.runtime.security import redact_url

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "specdec:"
SESSION_TTL_S = 3600
SINGLE_TURN_TTL_S = 300  # a single-turn record outlives its stream only if the stream never ends
HEARTBEAT_S = 2.0
MAX_ENTRY_BYTES = 4096  # a registry entry is a few hundred bytes; a larger value is ignored unparsed
MAX_REPLICAS = 1024  # replicas of one role read from the index at most (its lowest-scored first)
CLOCK_SKEW_S = 30.0  # an entry's own `seen` may lag this much past its TTL (hosts' clocks differ)
RETRY_BEAT_S = 0.25  # a replica's next try while Redis does not answer

log = logging.getLogger(__name__)


class StoreUnavailable(Unavailable):
    """Redis did not answer (down, unreachable, or timed out)."""


def connect(url: str = DEFAULT_URL, *, timeout_s: float = 1.0) -> aioredis.Redis:
    """An asyncio Redis client with short timeouts (fail fast instead of hanging).

    TLS: a `rediss://` URL; redis-py reads its TLS settings from the query
    (`?ssl_ca_certs=/path/ca.crt&ssl_certfile=...&ssl_keyfile=...`). A password
    the URL does not carry comes from SPECDEC_REDIS_PASSWORD (out of argv and logs),
    and a user name from SPECDEC_REDIS_USERNAME (a Redis ACL user: each role its own).
    """
    return aioredis.Redis.from_url(
        url,
        username=os.environ.get("SPECDEC_REDIS_USERNAME") or None,
        password=os.environ.get("SPECDEC_REDIS_PASSWORD") or None,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry_on_timeout=False,
        decode_responses=False,
    )


async def _guard(what: str, url: str, coro: Awaitable):
    """Await a Redis call, turning every Redis failure into StoreUnavailable."""
    try:
        return await coro
    except (RedisError, OSError, asyncio.TimeoutError) as exc:
        raise StoreUnavailable(
            f"the session store is unavailable ({what})",
            detail=f"redis at {redact_url(url)}: {type(exc).__name__}: {exc}",
        ) from exc


# --------------------------------------------------------------------- sessions


@dataclass(frozen=True)
class SessionRecord:
    """Everything needed to resume a session on any orchestrator replica."""

    session_id: str
    tokens: tuple[int, ...] = ()  # committed token ids (prompt + generated)
    target: str = ""  # replica address holding the target KV
    target_len: int = 0  # committed tokens that replica holds
    draft: str = ""
    draft_len: int = 0
    turn_start: int = 0  # index of the current turn's first generated token (its prompt length)
    turn_seed: int = 0  # the seed the current turn samples with
    multi_turn: bool = False  # kept for later turns (session TTL; Redis field "keep"); else single-turn (short TTL)
    created: float = 0.0
    updated: float = 0.0
    tenant: str = ""  # who created it; nobody else may see or continue it

    def to_hash(self) -> dict[str, bytes]:
        return {
            "tokens": array("i", self.tokens).tobytes(),
            "target": self.target.encode(),
            "target_len": str(self.target_len).encode(),
            "draft": self.draft.encode(),
            "draft_len": str(self.draft_len).encode(),
            "turn_start": str(self.turn_start).encode(),
            "turn_seed": str(self.turn_seed).encode(),
            "keep": b"1" if self.multi_turn else b"0",
            "created": repr(self.created).encode(),
            "updated": repr(self.updated).encode(),
            "tenant": self.tenant.encode(),
        }

    @classmethod
    def from_hash(cls, session_id: str, h: dict[bytes, bytes]) -> SessionRecord:
        tokens = array("i")
        tokens.frombytes(h.get(b"tokens", b""))
        return cls(
            session_id=session_id,
            tokens=tuple(tokens),
            target=h.get(b"target", b"").decode(),
            target_len=int(h.get(b"target_len", b"0")),
            draft=h.get(b"draft", b"").decode(),
            draft_len=int(h.get(b"draft_len", b"0")),
            turn_start=int(h.get(b"turn_start", b"0")),
            turn_seed=int(h.get(b"turn_seed", b"0")),
            multi_turn=h.get(b"keep", b"1") == b"1",  # records from before the flag were all multi-turn
            created=float(h.get(b"created", b"0")),
            updated=float(h.get(b"updated", b"0")),
            tenant=h.get(b"tenant", b"").decode(),
        )


# The saves of one event-loop turn, as one command: per record its HSET and EXPIRE and, for a kept
# session, its place in its tenant's count. A script runs atomically, like the MULTI/EXEC it replaces,
# and costs the orchestrator one command to pack and one reply to read instead of two to four each
# per record (about half the CPU of a save, measured: docs/benchmarks.md).
# KEYS: per record its key, then its tenant's kept-set key when it is kept.
# ARGV: now, then per record: TTL, kept (0/1), session id, field count, then field, value pairs.
SAVE_SCRIPT = """
local now = tonumber(ARGV[1])
local k, a = 1, 2
while a <= #ARGV do
  local ttl, kept, nf = tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 3])
  redis.call('HSET', KEYS[k], unpack(ARGV, a + 4, a + 3 + 2 * nf))
  redis.call('EXPIRE', KEYS[k], ttl)
  if kept == '1' then
    redis.call('ZADD', KEYS[k + 1], now + ttl, ARGV[a + 2])
    redis.call('EXPIRE', KEYS[k + 1], ttl)
    k = k + 1
  end
  k, a = k + 1, a + 4 + 2 * nf
end
return k - 1
"""


class SessionStore:
    """Session records as Redis hashes under `<prefix>session:<id>`, each with a TTL
    (`ttl_s` for kept sessions, `single_turn_ttl_s` for single-turn ones).

    Saves made in the same turn of the event loop share one call of `SAVE_SCRIPT` (each
    record's HSET and EXPIRE inside it, atomically), so many sessions' rounds cost one round
    trip to Redis, not one each; a failure fails every save of that batch, and
    each session's writer retries its own (orchestrator.round.sessions)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        url: str = DEFAULT_URL,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: int = SESSION_TTL_S,
        single_turn_ttl_s: int = SINGLE_TURN_TTL_S,
    ) -> None:
        self._r = client
        self._url = url
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.single_turn_ttl_s = min(single_turn_ttl_s, ttl_s)
        # (key, fields, TTL, future, (kept-set key or None, session id)), gathered for the next SAVE_SCRIPT call
        self._saves: list[tuple[str, dict, int, asyncio.Future, tuple[str | None, str]]] = []
        self.save_batches = 0  # SAVE_SCRIPT calls sent for saves (the batching's own count)
        self._save_script = client.register_script(SAVE_SCRIPT)  # EVALSHA; loaded again after a restart

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def _kept_key(self, tenant: str) -> str:
        return f"{self.prefix}kept:{tenant}"

    async def kept(self, tenant: str) -> int:
        """How many kept (multi-turn) sessions `tenant` holds (records past their TTL are not counted)."""
        key = self._kept_key(tenant)
        pipe = self._r.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", time.time())
        pipe.zcard(key)
        _, count = await _guard("kept sessions count", self._url, pipe.execute())
        return int(count)

    async def load(self, session_id: str) -> SessionRecord | None:
        h = await _guard("session load", self._url, self._r.hgetall(self._key(session_id)))
        return SessionRecord.from_hash(session_id, h) if h else None

    async def save(self, record: SessionRecord) -> SessionRecord:
        """Write the whole record and refresh its TTL, atomically (one SAVE_SCRIPT call with the other
        saves of this turn of the event loop)."""
        now = time.time()
        record = replace(record, created=record.created or now, updated=now)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._saves:
            loop.call_soon(lambda: loop.create_task(self._write_saves()))
        kept = self._kept_key(record.tenant) if record.multi_turn else None
        self._saves.append((self._key(record.session_id), record.to_hash(),
                            self.ttl_s if record.multi_turn else self.single_turn_ttl_s, future,
                            (kept, record.session_id)))
        await future
        return record

    async def _write_saves(self) -> None:
        saves, self._saves = self._saves, []
        now = time.time()
        keys: list[str] = []
        args: list = [repr(now)]
        for key, mapping, ttl, _, (kept, session_id) in saves:
            keys.append(key)
            if kept is not None:  # counted per tenant until the record's own expiry
                keys.append(kept)
            args += (ttl, b"0" if kept is None else b"1", session_id, len(mapping))
            for name, value in mapping.items():
                args += (name, value)
        self.save_batches += 1
        try:
            await _guard("session save", self._url, self._save_script(keys=keys, args=args))
        except BaseException as exc:  # every save of the batch shares the failure
            for _, _, _, future, _ in saves:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else StoreUnavailable(
                        "the session store is unavailable (session save)"))
            if not isinstance(exc, Exception):
                raise
            return
        for _, _, _, future, _ in saves:
            if not future.done():
                future.set_result(None)

    async def delete(self, session_id: str) -> bool:
        """Delete a record (and, a kept one, its place in its tenant's count)."""
        key = self._key(session_id)
        pipe = self._r.pipeline(transaction=True)
        pipe.hmget(key, ["tenant", "keep"])
        pipe.delete(key)
        (tenant, keep), n = await _guard("session delete", self._url, pipe.execute())
        if keep == b"1":
            await _guard("session delete", self._url,
                         self._r.zrem(self._kept_key((tenant or b"").decode()), session_id))
        return bool(n)

    async def ping(self) -> None:
        await _guard("ping", self._url, self._r.ping())


async def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under `prefix` (a test's or a launch's own namespace); returns the count."""
    if not prefix:
        raise ValueError("refusing to delete with an empty prefix")
    client = connect(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await _guard("delete", url, client.delete(*keys))
        return len(keys)
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(
            "the session store is unavailable (delete)",
            detail=f"redis at {redact_url(url)}: {type(exc).__name__}: {exc}",
        ) from exc
    finally:
        await client.aclose()


# --------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ServiceEntry:
    """One live model-service replica as it announces itself."""

    address: str  # host:port other processes dial
    role: str  # "target" or "draft"
    replica_id: str
    model_name: str = ""
    tokenizer_fingerprint: str = ""
    load: float = 0.0  # sessions held / in-flight work; lower is preferred
    seen: float = 0.0  # unix time of the last heartbeat


_ENTRY_TYPES = {"address": str, "role": str, "replica_id": str, "model_name": str,
                "tokenizer_fingerprint": str, "load": (int, float), "seen": (int, float)}
_REQUIRED = ("address", "role", "replica_id")


class BadEntry(ValueError):
    """A registry value that is no usable ServiceEntry (the message says why)."""


def parse_entry(raw: bytes | str) -> tuple[ServiceEntry, list[str]]:
    """A registry value as a ServiceEntry, and the unknown fields it carried (ignored);
    BadEntry when it is no JSON object, lacks a required field or has a field of the wrong type."""
    try:
        fields = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadEntry("not JSON") from exc
    if not isinstance(fields, dict):
        raise BadEntry("not a JSON object")
    missing = [name for name in _REQUIRED if not fields.get(name)]
    if missing:
        raise BadEntry(f"missing {', '.join(missing)}")
    known = {k: v for k, v in fields.items() if k in _ENTRY_TYPES}
    wrong = [k for k, v in known.items() if isinstance(v, bool) or not isinstance(v, _ENTRY_TYPES[k])]
    if wrong:
        raise BadEntry(f"wrong type of {', '.join(sorted(wrong))}")
    return ServiceEntry(**known), sorted(set(fields) - set(known))


@dataclass
class Expected:
    """What an orchestrator accepts from the registry: its tokenizer's fingerprint (required of
    every entry) and, once known, the model each role serves."""

    fingerprint: str = ""
    models: dict[str, str] = field(default_factory=dict)  # role -> model_name
    # role -> its own tokenizer's fingerprint where it differs (a draft with another tokenizer)
    fingerprints: dict[str, str] = field(default_factory=dict)

    def mismatch(self, entry: ServiceEntry) -> str:
        """Why `entry` is not one of ours ("" if it is)."""
        expected = self.fingerprints.get(entry.role, self.fingerprint)
        if not expected:
            return ""
        if not entry.tokenizer_fingerprint:
            return "it has no tokenizer fingerprint"
        if entry.tokenizer_fingerprint != expected:
            return (f"its tokenizer fingerprint {entry.tokenizer_fingerprint[:12]} is not "
                    f"{expected[:12]}")
        model = self.models.get(entry.role)
        if model and entry.model_name != model:
            return f"it serves {entry.model_name!r}, not {model!r}"
        return ""


class ServiceRegistry:
    """Replicas by role: a key per replica with a TTL, plus a per-role index."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        url: str = DEFAULT_URL,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float = 3 * HEARTBEAT_S,
        expected: Expected | None = None,
    ) -> None:
        self._r = client
        self._url = url
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.expected = expected or Expected()
        self._reported: set[tuple[str, str]] = set()  # (key, problem) already logged
        self._reads: dict[str, asyncio.Future] = {}  # role -> its `live` read under way

    def _key(self, role: str, replica_id: str) -> str:
        return f"{self.prefix}service:{role}:{replica_id}"

    def _index(self, role: str) -> str:
        return f"{self.prefix}services:{role}"

    async def register(self, entry: ServiceEntry) -> None:
        """Announce (or refresh) a replica; it expires unless refreshed within ttl_s."""
        now = time.time()
        entry = replace(entry, seen=now)
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._key(entry.role, entry.replica_id), json.dumps(asdict(entry)),
                 px=int(self.ttl_s * 1000))
        pipe.zadd(self._index(entry.role), {entry.replica_id: now + self.ttl_s})
        # The index outlives no entry in it: once every replica of the role stops
        # beating it expires with them (each beat sets it to its own entry's expiry, the latest).
        pipe.pexpire(self._index(entry.role), int(self.ttl_s * 1000))
        await _guard("service register", self._url, pipe.execute())

    async def deregister(self, role: str, replica_id: str) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self._key(role, replica_id))
        pipe.zrem(self._index(role), replica_id)
        await _guard("service deregister", self._url, pipe.execute())

    async def live(self, role: str) -> list[ServiceEntry]:
        """Replicas of `role` whose heartbeat has not expired, lowest load first.

        Calls made while a read of the role is under way share it: every new session reads the
        registry, and a burst of them costs one read (and one Redis connection), not one each."""
        read = self._reads.get(role)
        if read is None or read.get_loop() is not asyncio.get_running_loop():
            read = self._reads[role] = asyncio.ensure_future(self._read_live(role))
            read.add_done_callback(partial(self._read_done, role))
        return list(await asyncio.shield(read))  # a caller that goes away leaves the read to the others

    def _read_done(self, role: str, read: asyncio.Future) -> None:
        if self._reads.get(role) is read:
            del self._reads[role]
        if not read.cancelled():
            read.exception()  # each caller raises it; none may be left to retrieve it

    async def _read_live(self, role: str) -> list[ServiceEntry]:
        now = time.time()
        index = self._index(role)
        pipe = self._r.pipeline(transaction=False)
        pipe.zremrangebyscore(index, "-inf", now)
        pipe.zrange(index, 0, MAX_REPLICAS - 1)
        _, ids = await _guard("service list", self._url, pipe.execute())
        if not ids:
            return []
        keys = [self._key(role, i.decode()) for i in ids]
        raw = await _guard("service list", self._url, self._r.mget(keys))
        entries = [e for key, value in zip(keys, raw) if value is not None
                   and (e := self._usable(key, role, value)) is not None]
        return sorted(entries, key=lambda e: (e.load, e.replica_id))

    def _usable(self, key: str, role: str, value: bytes) -> ServiceEntry | None:
        """The entry under `key` if it is well-formed, fresh and one of ours; else None, logged once.
        Fresh: its own heartbeat time within the TTL (plus clock skew), so a value written without
        a TTL, or kept alive in the index by a far-future score, stops counting once it stops
        beating."""
        if len(value) > MAX_ENTRY_BYTES:
            self._report(key, f"ignored: {len(value)} bytes, above {MAX_ENTRY_BYTES}")
            return None
        try:
            entry, unknown = parse_entry(value)
        except BadEntry as exc:
            self._report(key, f"ignored: {exc}")
            return None
        if unknown:
            self._report(key, f"fields {', '.join(unknown)} ignored")
        problem = f"it names role {entry.role!r}" if entry.role != role else self.expected.mismatch(entry)
        age = time.time() - entry.seen
        if not problem and abs(age) > self.ttl_s + CLOCK_SKEW_S:
            problem = (f"its last heartbeat is {age:.0f} s old (a TTL of {self.ttl_s:g} s)" if age > 0
                       else f"its heartbeat is {-age:.0f} s in the future")
        if problem:
            self._report(key, f"ignored: {problem}")
            return None
        return entry

    def _report(self, key: str, problem: str) -> None:
        """One log line per entry and problem (live() runs for every request)."""
        if (key, problem) not in self._reported:
            if len(self._reported) > 4096:
                self._reported.clear()
            self._reported.add((key, problem))
            log.warning("service registry entry %s: %s", key, problem)


async def heartbeat(
    registry: ServiceRegistry,
    entry: ServiceEntry,
    *,
    load: Callable[[], float] | None = None,
    interval_s: float = HEARTBEAT_S,
) -> None:
    """Register `entry` every `interval_s` until cancelled, then deregister.

    A Redis outage is survived: the beat keeps trying, every RETRY_BEAT_S
    while Redis does not answer, so the replica reappears soon after Redis is
    back (a restarted Redis holds no registry).
    """
    try:
        while True:
            try:
                await registry.register(replace(entry, load=load() if load else entry.load))
                pause = interval_s
            except StoreUnavailable:
                pause = min(interval_s, RETRY_BEAT_S)
            await asyncio.sleep(pause)
    finally:
        try:
            await asyncio.shield(registry.deregister(entry.role, entry.replica_id))
        except (StoreUnavailable, asyncio.CancelledError):
            pass

"""Which replica serves a session: registry discovery, session affinity, static fallback.

Replicas come from the Redis service registry (live heartbeats, matching the
target's tokenizer fingerprint). When the registry has none of a role, the
static `--target` / `--draft` addresses are used. A session stays on the
replica holding its KV while that replica is live; a new session goes to the
least-loaded replica, counting sessions this process sent there since the
replica's last heartbeat (so a burst does not pile onto one replica). While
Redis is unreachable, the replicas it listed last are used (a dead one is
then found by the call itself, which moves the session).

Replicas that `health` (orchestrator.fleet.outliers) has ejected, hung or far slower
than their peers, get no new sessions and lose the sessions on them, unless
every replica of the role is ejected: then they are used anyway.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Collection, Sequence

from orchestrator.fleet.outliers import ReplicaHealth
from orchestrator.fleet.remote import ModelClient, release_in_background
from orchestrator.fleet.identity import PeerRoles
from specdec.core.fingerprint import EMPTY
from specdec.runtime.store import ServiceRegistry, StoreUnavailable
from specdec.v1 import model_pb2


class Router:
    def __init__(
        self,
        registry: ServiceRegistry | None,
        static: dict[str, Sequence[str]],
        *,
        fingerprint: str = "",
        timeout_s: float = 60.0,
        connect: Callable[[str, str], ModelClient] | None = None,
        health: ReplicaHealth | None = None,
        roles: PeerRoles | None = None,
    ) -> None:
        self.registry = registry
        self.roles = roles  # with TLS to the services: each replica's certificate names its role
        self.static = {role: list(addrs) for role, addrs in static.items()}
        self.fingerprint = fingerprint
        self.fingerprints: dict[str, str] = {}  # role -> its own tokenizer's, where it differs
        self.timeout_s = timeout_s
        # (address, role) -> a client; tests inject in-process fakes here.
        self._connect = connect or (lambda address, role: ModelClient(address, role, timeout_s=timeout_s))
        self._clients: dict[str, ModelClient] = {}
        self._picks: dict[str, list[float]] = {}  # address -> times this process routed to it
        self._rr = 0
        self._last_live: dict[str, list[tuple[str, float, float]]] = {}  # role -> the registry's last answer
        self.health = health or ReplicaHealth()
        self.health.probe = self.probe

    def client(self, address: str, role: str) -> ModelClient:
        """One channel per (address); reused by every session."""
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = self._connect(address, role)
        return client

    async def candidates(self, role: str) -> list[tuple[str, float, float]]:
        """(address, load, last heartbeat) of usable replicas of `role`: listed, and (with TLS to
        the services) presenting a certificate that names the role."""
        listed = await self._listed(role)
        if self.roles is None or not self.roles.on:
            return listed
        named = [await self.roles.named(address, role) for address, _, _ in listed]
        return [o for o, ok in zip(listed, named) if ok]

    async def _listed(self, role: str) -> list[tuple[str, float, float]]:
        """(address, load, last heartbeat) of the replicas of `role` the registry (or the flags) list."""
        if self.registry is not None:
            try:
                entries = await self.registry.live(role)
            except StoreUnavailable:
                if not self._last_live.get(role) and not self.static.get(role):
                    raise
                entries = None
            expected = self.fingerprints.get(role, self.fingerprint)
            live = [
                (e.address, e.load, e.seen)
                for e in entries or ()
                if not expected or not e.tokenizer_fingerprint or e.tokenizer_fingerprint == expected
            ]
            if live:
                self._last_live[role] = live
            elif entries is None or _recent(self._last_live.get(role, []), self.registry.ttl_s):
                # Redis down, or restarted empty and the replicas have not beaten yet.
                live = self._last_live.get(role, [])
            if live:
                return live
        return [(address, 0.0, 0.0) for address in self.static.get(role, [])]

    async def pick(self, role: str, preferred: str = "", exclude: Collection[str] = (), *,
                   healthy: bool = False, room: Callable[[str], bool] | None = None) -> ModelClient | None:
        """The replica for a session: `preferred` if still usable, else the least loaded.

        Replicas in `exclude` (ones that just failed) are never picked; ejected
        ones only when every other is ejected too, and never with `healthy`.
        With `room`, only replicas for which room(address) holds (admission).
        """
        options = [o for o in await self.candidates(role) if o[0] not in exclude]
        fine = [o for o in options if not self.health.ejected(role, o[0])]
        options = fine if fine or healthy else options
        if room is not None:
            options = [o for o in options if room(o[0])]
        if not options:
            return None
        addresses = [a for a, _, _ in options]
        if preferred in addresses:
            return self.client(preferred, role)
        now = time.time()

        def pending(address: str, seen: float) -> int:
            picks = self._picks.setdefault(address, [])
            picks[:] = [t for t in picks if t > max(seen, now - 60.0)]
            return len(picks)

        self._rr += 1
        ranked = sorted(
            enumerate(options),
            key=lambda io: (io[1][1] + pending(io[1][0], io[1][2]), (io[0] + self._rr) % len(options)),
        )
        address = ranked[0][1][0]
        self._picks.setdefault(address, []).append(now)
        return self.client(address, role)

    async def probe(self, role: str, address: str, timeout_s: float) -> float:
        """One tiny real call to a replica (ReplicaHealth's probe): wall milliseconds.

        A 2-token Score (k = 0), or a 2-token Propose drafting one token, on a
        throwaway session that is released right after, and that leaves the replica's batch
        calls at once (else, for STALE_S, every batch there would wait its bound for it).
        """
        client = self.client(address, role)
        session = f"probe-{uuid.uuid4().hex}"
        if role == "target":
            call = client.score(model_pb2.ScoreRequest(session_id=session, prefix_hash=EMPTY, tokens=[0, 0]))
        else:
            call = client.propose(model_pb2.ProposeRequest(session_id=session, prefix_hash=EMPTY,
                                                           tokens=[0, 0], k=1))
        started = time.monotonic()
        try:
            await asyncio.wait_for(call, timeout_s)
        finally:
            client.leave(session)
            release_in_background(session, client)
        return (time.monotonic() - started) * 1e3

    async def close(self) -> None:
        await self.health.close()
        for client in self._clients.values():
            await client.close()


def _recent(entries: Sequence[tuple[str, float, float]], ttl_s: float) -> bool:
    """Whether a heartbeat in `entries` is younger than one registry TTL."""
    return any(time.time() - seen < ttl_s for _, _, seen in entries)

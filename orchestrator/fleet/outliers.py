"""Outlier routing: a replica that misses deadlines or runs far slower than its peers is ejected.

Envoy's outlier detection, for gray failures: a replica that is alive but
hung or slow. `ReplicaHealth` (one per orchestrator process, on the Router)
holds the learned latency tables (orchestrator.fleet.deadlines) and, per replica:

  ejected    after a call missed its deadline (reason "deadline"), or when its
             answers (within `window_s`, since it was last admitted), each taken
             as its wall time over its peers' usual wall time for the same size
             of work (their latest figures, however old), are `slow_ratio` slower
             (reason "slow"): the median of its last `min_samples` answers, or,
             for a replica that runs in bursts (a CPU quota, a duty cycle: fast
             answers between long stalls, so the median stays fast), the total
             time of its last BURST_SAMPLES x `min_samples` answers against its
             peers' total for the same work, with at least 2 of them that slow
             (one freak answer never ejects). Answers, not
             its table: a size it served fast before it slowed, and has not
             served since, must not outvote the sizes it serves now. An ejected replica gets no new sessions
             (Router.pick) and the sessions on it move at their next round
             (SessionReplica.ready): a target session is resent from 0 on
             another replica, a draft session moves to another draft or sits
             out its rounds (target-only or lookup) until the draft is back.
             Where every replica of a role is ejected, routing uses them
             anyway: a suspect target beats none.
  probed     while ejected, a background task sends the replica one tiny real
             call (a 2-token Score, or a 2-token Propose drafting one) after
             `eject_s`, doubling up to `max_eject_s` while it fails. It is
             admitted again once the probe answers within its deadline and,
             when a healthy peer exists, the mean of 5 probes spaced at random
             is below `slow_ratio` x the mean of as many on that peer. A replica
             whose probes have failed for `forget_s` is forgotten (it is
             usually gone from the registry by then; if it is called again,
             its calls decide anew).

Every ejection and readmission is logged and counted:
`specdec_replica_ejected{role,address}` (1 while ejected),
`specdec_replica_ejections_total{role,reason}`, `specdec_deadline_misses_total{role}`,
`specdec_session_moves_total{role,reason}`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from orchestrator.fleet.deadlines import DeadlinePolicy, LatencyBook, bucket_of

log = logging.getLogger(__name__)

DEADLINE_MISSES = Counter("specdec_deadline_misses_total",
                          "Model-service calls that missed their learned deadline", ["role"])
EJECTIONS = Counter("specdec_replica_ejections_total",
                    "Replicas ejected from routing (deadline: a call missed its deadline; "
                    "slow: far slower than its peers for the same work)", ["role", "reason"])
EJECTED = Gauge("specdec_replica_ejected", "1 while the replica is ejected from routing",
                ["role", "address"])
SESSION_MOVES = Counter("specdec_session_moves_total",
                        "Sessions moved to another replica (ejected: off an ejected replica "
                        "before a call; deadline: a call missed its deadline)", ["role", "reason"])

# Probe(role, address, timeout_s) -> wall ms of one tiny real call; raises if it fails.
Probe = Callable[[str, str, float], Awaitable[float]]
PROBE_SIZE = {"target": 2, "draft": 3}  # tokens of work in a probe (Propose: 2 fed + 1 drafted)
BURST_SAMPLES = 4  # x min_samples: the answers whose total time judges a replica that runs in bursts
BURST_SLOW = 2  # ... of which at least this many must be slow_ratio slower by themselves


@dataclass(frozen=True)
class OutlierPolicy:
    """When a replica is ejected and how it comes back (orchestrator flags --outlier-*, --eject-*)."""

    slow_ratio: float = 3.0  # x the peers' median wall time for the same work; 0 = off
    min_samples: int = 5  # answers judged at once: the median of the last so many (since admission)
    window_s: float = 30.0  # a replica is judged on its answers this recent
    eject_s: float = 1.0  # first ejection; doubles while its probes fail
    max_eject_s: float = 8.0
    forget_s: float = 120.0  # probes failing this long: stop probing, forget the replica
    probes: int = 5  # probe calls per check (and as many on a peer) when comparing with a peer


@dataclass
class _Ejection:
    reason: str
    since: float  # monotonic
    period_s: float
    task: asyncio.Task | None = None


class ReplicaHealth:
    """Deadlines and ejections for every replica this orchestrator calls (see the module docstring)."""

    def __init__(self, deadlines: DeadlinePolicy | None = None, policy: OutlierPolicy | None = None,
                 probe: Probe | None = None) -> None:
        self.latency = LatencyBook(deadlines)
        self.policy = policy or OutlierPolicy()
        self.probe = probe  # set by the Router (it owns the clients)
        self._ejected: dict[tuple[str, str], _Ejection] = {}
        # (role, address) -> (monotonic, answer's ms, peers' usual ms for that work) of its latest answers
        self._paces: dict[tuple[str, str], collections.deque[tuple[float, float, float]]] = {}

    # ---- what callers ask -------------------------------------------------------

    def deadline_s(self, role: str, address: str, size: int) -> float | None:
        return self.latency.deadline_s(role, address, size)

    def ejected(self, role: str, address: str) -> bool:
        return (role, address) in self._ejected

    def ejection_reason(self, role: str, address: str) -> str:
        e = self._ejected.get((role, address))
        return e.reason if e else ""

    # ---- what callers report ----------------------------------------------------

    def answered(self, role: str, address: str, size: int, ms: float) -> None:
        """A call answered within its deadline in `ms`: learn it, then judge the replica's pace."""
        table = self.latency.replica(role, address)
        table.observe(size, ms)
        if self.ejection_reason(role, address) == "deadline":
            # Still in use where it is the only one of its role: an answer in time is better
            # evidence than the next probe.
            self.readmit(role, address, "a call answered within its deadline")
        p = self.policy
        if self.ejected(role, address) or p.slow_ratio <= 0:
            return
        usual = self._peers_usual(role, address, size)
        if usual is None:
            return
        now = time.monotonic()
        n = max(1, p.min_samples)
        paces = self._paces.get((role, address))
        if paces is None:
            paces = self._paces[(role, address)] = collections.deque(maxlen=BURST_SAMPLES * n)
        paces.append((now, ms, usual))
        recent = [(mine, theirs) for seen, mine, theirs in paces if now - seen <= p.window_s]
        last = [mine / theirs for mine, theirs in recent[-n:]]
        if len(last) >= n and (slow := statistics.median(last)) >= p.slow_ratio:
            self.eject(role, address, "slow", f"{slow:.1f}x its peers' wall time for the same work "
                       f"(the median of its last {len(last)} answers)")
            return
        if len(recent) < BURST_SAMPLES * n:
            return
        total = sum(mine for mine, _ in recent) / sum(theirs for _, theirs in recent)
        stalls = sum(mine >= p.slow_ratio * theirs for mine, theirs in recent)
        if total >= p.slow_ratio and stalls >= BURST_SLOW:
            self.eject(role, address, "slow", f"{total:.1f}x its peers' wall time for the same work in all "
                       f"over its last {len(recent)} answers, {stalls} of them stalled (it runs in bursts)")

    def missed(self, role: str, address: str, size: int, deadline_s: float) -> None:
        """A call of `size` tokens did not answer within `deadline_s`."""
        DEADLINE_MISSES.labels(role).inc()
        usual = self.latency.usual_ms(role, address, size)
        usual_text = f"usually {usual:.1f} ms" if usual is not None else "nothing measured yet"
        self.eject(role, address, "deadline",
                   f"no answer within {deadline_s * 1e3:.0f} ms for {size} tokens ({usual_text})")

    def _peers_usual(self, role: str, address: str, size: int) -> float | None:
        """The usual ms for `size` tokens on this replica's peers: the median of the healthy peers'
        latest figures, however old (routing may have sent every recent session here); None
        without a healthy peer that has served that size."""
        key = bucket_of(size)
        theirs = [t.buckets[key].ms for (r, a), t in self.latency.replicas.items()
                  if r == role and a != address and key in t.buckets and not self.ejected(r, a)]
        if not theirs:  # a lone replica has no pace to be judged against
            return None
        return max(statistics.median(theirs), 1e-3)

    # ---- ejection and readmission -------------------------------------------------

    def eject(self, role: str, address: str, reason: str, detail: str) -> None:
        key = (role, address)
        if key in self._ejected:
            return
        p = self.policy
        ejection = self._ejected[key] = _Ejection(reason, time.monotonic(), p.eject_s)
        EJECTIONS.labels(role, reason).inc()
        EJECTED.labels(role, address).set(1)
        log.warning("%s replica %s ejected from routing (%s: %s); probing it again in %.1f s",
                    role, address, reason, detail, p.eject_s)
        if self.probe is not None:
            try:
                ejection.task = asyncio.get_running_loop().create_task(self._probe_loop(role, address))
            except RuntimeError:  # no running loop (a unit test): stays ejected until readmitted
                pass

    def readmit(self, role: str, address: str, why: str) -> None:
        ejection = self._ejected.pop((role, address), None)
        if ejection is None:
            return
        EJECTED.labels(role, address).set(0)
        self._paces.pop((role, address), None)  # judged again on new answers only
        log.info("%s replica %s back in rotation after %.1f s ejected (%s): %s", role, address,
                 time.monotonic() - ejection.since, ejection.reason, why)

    async def _probe_loop(self, role: str, address: str) -> None:
        key = (role, address)
        while (ejection := self._ejected.get(key)) is not None:
            await asyncio.sleep(ejection.period_s)
            verdict = await self._check(role, address)
            if verdict is None:
                self.readmit(role, address, "its probe answered in time")
                return
            if time.monotonic() - ejection.since > self.policy.forget_s:
                self._ejected.pop(key, None)
                EJECTED.remove(role, address)
                self.latency.replicas.pop(key, None)
                self._paces.pop(key, None)
                log.warning("%s replica %s: probes failing for %.0f s (%s); forgotten", role,
                            address, self.policy.forget_s, verdict)
                return
            ejection.period_s = min(2 * ejection.period_s, self.policy.max_eject_s)
            log.info("%s replica %s still ejected: %s; next probe in %.1f s", role, address,
                     verdict, ejection.period_s)

    async def _check(self, role: str, address: str) -> str | None:
        """None when the replica answers a probe in time (and is not far slower than a healthy
        peer on the same probes); else why not."""
        size = PROBE_SIZE[role]
        timeout = self.deadline_s(role, address, size) or self.latency.policy.cold_s
        peer = self._healthy_peer(role, address)
        try:
            mine = [await self.probe(role, address, timeout)]
            if peer is None or self.policy.slow_ratio <= 0:
                return None
            theirs = [await self.probe(role, peer, timeout)]
            for _ in range(self.policy.probes - 1):
                # Spaced at random: a CPU-starved replica runs in bursts (a cgroup quota, a
                # duty cycle), and probes sent back to back would all land in one burst.
                await asyncio.sleep(random.uniform(0.02, 0.12))
                mine.append(await self.probe(role, address, timeout))
                theirs.append(await self.probe(role, peer, timeout))
        except Exception as exc:  # noqa: BLE001 - any failure: still not usable
            return f"probe failed: {type(exc).__name__}: {exc}"
        ratio = statistics.mean(mine) / max(statistics.mean(theirs), 1e-3)
        if ratio >= self.policy.slow_ratio:
            return f"probes {ratio:.1f}x a peer's"
        return None

    def _healthy_peer(self, role: str, address: str) -> str | None:
        """The non-ejected peer that answered last, if any (probed side by side with the suspect)."""
        peers = [(max((b.seen for b in t.buckets.values()), default=0.0), a)
                 for (r, a), t in self.latency.replicas.items()
                 if r == role and a != address and not self.ejected(r, a) and t.buckets]
        return max(peers)[1] if peers else None

    def snapshot(self) -> dict[str, str]:
        """'role address' -> reason, for every replica ejected now."""
        return {f"{r} {a}": e.reason for (r, a), e in self._ejected.items()}

    async def close(self) -> None:
        tasks = [e.task for e in self._ejected.values() if e.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

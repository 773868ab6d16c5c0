"""Overload is shed, never queued forever: new streams only go to a target replica with room.

A target replica serves its sessions in shared forwards (continuous
batching). Each added session makes every session's forward dearer, so past
some number of sessions the admitted streams lose their pace; past its batch
limit, calls queue. `TargetAdmission` places each new stream on a target
replica that has room, and refuses the stream (RESOURCE_EXHAUSTED naming the
limit, with a retry-after hint that the gateway turns into HTTP 429
`Retry-After`) when none has, after a short bounded wait.

A replica's capacity in sessions, measured from its own batches and queues:

  * at most its batch size (GetInfo max_batch: sessions one forward holds);
  * none at all while its calls wait in its queue for more than
    `queue_factor` x a round (ServerTiming: server time minus forward time);

and with a pace (`--capacity-pace P`, off by default: it trades throughput for
each admitted stream's pace) also

  * at most the sessions whose round (the RPC plus their shared forward) costs
    `pace` x a lone session's round, from the replica's measured cost table
    v(T) (orchestrator.policy.costs) and its calls' RPC time;
  * at most a limit fed back from the pace its admitted streams actually get:
    round times against rounds run alone (EWMAs per replica); slower than
    `pace` x the lone ones cuts the limit in proportion, well within it raises
    it by one (doubling from a slow start until the first cut, like TCP's window).

`--target-capacity N` sets the sessions per replica instead. A replica's load
is the streams this orchestrator has placed on it now; other orchestrators'
streams show in its queue (the saturation rule), since each admits on its own.
At most `queue_depth` streams wait for a slot at once (more: `admission_queue`),
none longer than `wait_s` (then `target_capacity`). Admitted streams are never
stopped. Between tenants (more than one in --auth-tokens), no tenant holds more than
`tenant_share` of the fleet's target slots at once (`target_share`, at once, no wait): a tenant
that opens every stream it can leaves the rest of the fleet to the others. The flags and measured figures: docs/operations.md, "Gray failures and
overload".
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from orchestrator.policy.costs import CostBook
from orchestrator.fleet.remote import SessionReplica
from specdec.runtime.limits import reject

if TYPE_CHECKING:
    from orchestrator.fleet.routing import Router

log = logging.getLogger(__name__)
DEFAULT_MAX_BATCH = 64  # a service that does not report its batch size (the services' default)
CAPACITY = Gauge("specdec_target_capacity_sessions",
                 "Streams a target replica can serve at pace (orchestrator.policy.capacity; 0: saturated)",
                 ["address"])
STREAMS = Gauge("specdec_target_streams", "Streams this orchestrator has admitted onto a target replica",
                ["address"])


@dataclass(frozen=True)
class CapacityPolicy:
    """Orchestrator flags --target-capacity, --capacity-pace, --admission-queue, --admission-wait-s."""

    sessions: int = 0  # sessions per target replica; 0 = measured
    # Admitted sessions' shared forward: at most this x a lone session's; 0 = off (the default:
    # continuous batching trades each stream's pace for throughput, and on a CPU a full batch
    # costs a few lone forwards, so a pace rule would admit a handful of streams per replica).
    pace: float = 0.0
    queue_factor: float = 4.0  # calls waiting longer than this x a round (RPC + forward): full
    queue_depth: int = 16  # streams waiting for a slot at once
    wait_s: float = 0.25  # the longest a stream waits for a slot
    # With several tenants: the most of all target replicas' slots one tenant holds; 1 = no limit.
    tenant_share: float = 0.5


@dataclass
class _Pace:
    """One replica's round times: alone (EWMA), and since the limit last changed; the limit."""

    lone_ms: float = 0.0
    lone_n: int = 0
    window_ms: float = 0.0  # sum of round times since the last change
    window_load: float = 0.0  # sum of the loads they ran at
    window_n: int = 0
    since: float = field(default_factory=time.monotonic)
    limit: int = 0  # 0: not set yet (no lone rounds)
    cut: bool = False  # cut once: from then on it grows by one, not by doubling

    @property
    def recent_ms(self) -> float:
        return self.window_ms / self.window_n if self.window_n else 0.0

    def observe(self, ms: float, load: int) -> None:
        if load <= 1:  # the lower envelope: quick to fall, slow to rise (others' load, hiccups)
            weight = 0.3 if ms < self.lone_ms else 0.02
            self.lone_ms = ms if not self.lone_n else self.lone_ms + weight * (ms - self.lone_ms)
            self.lone_n += 1
        self.window_ms += ms
        self.window_load += load
        self.window_n += 1

    def adjust(self, pace: float, model_cap: int) -> None:
        """Once the rounds since the last change are enough to judge (two per stream, 0.5 s):
        too slow, cut the limit in proportion (round time taken as growing with the load);
        well within the pace at the limit, double it (slow start, up to the cost model's
        capacity), or after a first cut add one."""
        load = self.window_load / max(1, self.window_n)
        if (self.lone_n < 3 or self.window_n < max(5, 2 * load)
                or time.monotonic() - self.since < 0.5):
            return
        self.limit = self.limit or max(1, min(model_cap, max(2, math.ceil(load))))  # a slow start
        target = pace * self.lone_ms
        if self.recent_ms > target:
            self.limit = max(1, min(self.limit - 1, int(load * target / self.recent_ms)))
            self.cut = True
        elif self.recent_ms < 0.8 * target and load >= self.limit - 0.5:
            self.limit = min(max(model_cap, self.limit + 1), self.limit + (1 if self.cut else self.limit))
        self.window_ms = self.window_load = 0.0
        self.window_n = 0
        self.since = time.monotonic()


class TargetAdmission:
    """Which target replica a new stream may start on, and the streams on each (one event loop)."""

    def __init__(self, policy: CapacityPolicy | None = None, costs: CostBook | None = None,
                 tenants: int = 1) -> None:
        self.policy = policy or CapacityPolicy()
        self.costs = costs or CostBook()
        self.tenants = tenants  # tenants that may call (--auth-tokens); the share applies past one
        self.active: dict[SessionReplica, float] = {}  # admitted streams' target places -> admitted at
        self._tenant_of: dict[SessionReplica, str] = {}  # and whose they are
        self.waiting = 0
        self._waiters: list[asyncio.Future] = []
        self._duration_s = 0.0  # EWMA of admitted streams' durations (the retry-after hint)
        self._pace: defaultdict[str, _Pace] = defaultdict(_Pace)
        self._shedding_logged = 0.0

    # ---- measurement ------------------------------------------------------------

    def capacity(self, router: Router, address: str) -> int:
        """Sessions this target replica can serve at pace now (0: saturated)."""
        if self.policy.sessions:
            return self.policy.sessions
        client = router.client(address, "target")
        most = int(getattr(client, "max_batch", 0) or 0) or DEFAULT_MAX_BATCH
        costs = self.costs.replicas.get(("target", address))
        if costs is None or not costs.measured:
            return most  # nothing measured yet: its batch size
        # A round's fixed part beside the forward: the RPC and (de)serializing (no queueing).
        rpc = max(0.0, costs.call_ms.value - costs.queue_ms.value)
        if costs.recent() and costs.queue_ms.value > self.policy.queue_factor * (rpc + costs.forward_ms.value):
            # Its calls wait for several rounds' worth: saturated, whoever loads it. Only calls
            # refresh that reading, so a replica none of this orchestrator's streams is on still
            # takes one: its probe (else a reading from a burst that has ended refuses a lone
            # stream until it ages out).
            return 0 if self.load(address) else 1
        if not self.policy.pace:
            return most
        row = max(1.0, costs.row_tokens.value)  # tokens a session's Score carries (k + 1)
        lone = rpc + costs.verify_ms(row)
        # The most sessions whose round keeps the pace (the cost table is not forced monotone:
        # one bumpy bucket must not cap it).
        model = max(n for n in range(1, most + 1)
                    if n == 1 or rpc + costs.verify_ms(n * row) <= self.policy.pace * lone)
        pace = self._pace.get(address)
        return min(model, pace.limit) if pace is not None and pace.limit else model

    def observe_round(self, router: Router, address: str, ms: float) -> None:
        """A round of an admitted stream on `address` took `ms` (its chunk gap): the pace feedback."""
        if self.policy.sessions or not self.policy.pace:
            return
        pace = self._pace[address]
        pace.observe(ms, self.load(address))
        before, recent, load = pace.limit, pace.recent_ms, pace.window_load / max(1, pace.window_n)
        pace.adjust(self.policy.pace, self.capacity(router, address))
        if pace.limit != before:
            log.info("target %s: admission limit %d -> %d (rounds %.0f ms at %.1f stream(s), %.0f ms "
                     "alone)", address, before, pace.limit, recent, load, pace.lone_ms)

    def load(self, address: str) -> int:
        """Streams this orchestrator has on the replica now (other orchestrators' show as its queue)."""
        return sum(1 for replica in self.active if replica.address == address)

    def retry_after_s(self, replicas: int) -> int:
        """When a slot is likely to free: a stream's usual duration over the slots in all."""
        if not self._duration_s:
            return 1
        return max(1, min(30, math.ceil(self._duration_s / max(1, replicas))))

    # ---- admission --------------------------------------------------------------

    def held_by(self, tenant: str) -> int:
        """Target slots `tenant`'s streams hold now."""
        return sum(1 for t in self._tenant_of.values() if t == tenant)

    def _check_share(self, caps: dict[str, int], tenant: str) -> None:
        """RESOURCE_EXHAUSTED target_share when `tenant` holds its share of the slots of the
        replicas in `caps` (all the usable ones, as just measured)."""
        total = sum(caps.values())
        if not total:
            return  # no replica (or all saturated): place() says so
        limit = max(1, int(self.policy.tenant_share * total))
        held = self.held_by(tenant)
        if held >= limit:
            raise reject("target_share",
                         f"this tenant's streams hold {held} of the {total} target slots, its share "
                         f"({self.policy.tenant_share:g} of them, --tenant-share) while other tenants "
                         "may call; retry when one of its streams ends",
                         retry_after_s=self.retry_after_s(len(caps)))

    async def place(self, router: Router, session_id: str, preferred: str, held: int, *,
                    wait_s: float, tenant: str = "") -> SessionReplica | None:
        """A target place for a new stream with room on its replica; None when there is no target
        replica at all for `wait_s`. Raises RESOURCE_EXHAUSTED when every replica is full, or
        when `tenant` holds its share of them (several tenants)."""
        shared = self.tenants > 1 and self.policy.tenant_share < 1.0
        caps: dict[str, int] = {}

        def room(address: str) -> bool:
            caps[address] = cap = self.capacity(router, address)
            return self.load(address) < cap

        no_replica_until = time.monotonic() + wait_s
        slot_until = time.monotonic() + self.policy.wait_s
        queued = False
        try:
            while True:
                caps.clear()
                client = await router.pick("target", preferred, room=room)
                if shared:  # no await from the pick to the record below: concurrent places count
                    self._check_share(caps, tenant)
                if client is not None:
                    replica = SessionReplica(router, "target", session_id, client,
                                             held if client.address == preferred else 0)
                    self.active[replica] = time.monotonic()
                    self._tenant_of[replica] = tenant
                    self._publish(caps)
                    return replica
                now = time.monotonic()
                if not caps:  # no target replica at all (yet)
                    if now >= no_replica_until:
                        return None
                    await asyncio.sleep(0.25)
                    continue
                if not queued:
                    if self.waiting >= self.policy.queue_depth:
                        raise reject("admission_queue",
                                     f"{self.policy.queue_depth} streams are already waiting for a "
                                     "target slot; retry later",
                                     retry_after_s=self.retry_after_s(len(caps)))
                    self.waiting, queued = self.waiting + 1, True
                if now >= slot_until:
                    self._publish(caps)
                    if now - self._shedding_logged > 10.0:
                        self._shedding_logged = now
                        log.warning("shedding load: %s (streams, capacity by replica: %s)",
                                    self._full_message(caps),
                                    {a: (self.load(a), c) for a, c in caps.items()})
                    raise reject("target_capacity", self._full_message(caps),
                                 retry_after_s=self.retry_after_s(len(caps)))
                await self._freed(slot_until - now)
        finally:
            if queued:
                self.waiting -= 1

    def _publish(self, caps: dict[str, int]) -> None:
        for address, cap in caps.items():
            CAPACITY.labels(address).set(cap)
            STREAMS.labels(address).set(self.load(address))

    def _full_message(self, caps: dict[str, int]) -> str:
        n = len(caps)
        sizes = sorted(set(caps.values()))
        each = ", ".join(str(c) for c in sizes)
        return (f"every target replica ({n}) is at its capacity ({each} session(s) each, "
                f"{'set by --target-capacity' if self.policy.sessions else 'measured'}); "
                f"waited {self.policy.wait_s:g} s; retry later")

    async def _freed(self, timeout_s: float) -> None:
        """Until a stream leaves (a slot may be free) or `timeout_s`."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def leave(self, replica: SessionReplica) -> None:
        """An admitted stream ended (any way): its slot is free."""
        admitted = self.active.pop(replica, None)
        self._tenant_of.pop(replica, None)
        if admitted is None:
            return
        STREAMS.labels(replica.address).set(self.load(replica.address))
        duration = time.monotonic() - admitted
        self._duration_s = duration if not self._duration_s else self._duration_s + 0.2 * (duration - self._duration_s)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def snapshot(self, router: Router, addresses: list[str]) -> dict[str, tuple[int, int]]:
        """address -> (load, capacity), for logs, metrics and benchmarks."""
        return {a: (self.load(a), self.capacity(router, a)) for a in addresses}


"""Deadlines learned from what each replica's calls normally take, for the same size of work.

A replica that hangs (SIGSTOP, a wedged device, a partition without resets)
answers nothing, so no error ever comes; only a deadline tells the
orchestrator to stop waiting. A fixed deadline is either too long for a
one-token verify (a hang costs seconds) or too short for a prefill. So every
attempt of a Score or Propose gets

    deadline = max(floor, factor x (the replica's usual wall time for this size
                                     + SPREAD x its usual deviation from that))

where the size is the tokens of work the call carries (tokens sent; for a
Propose plus its k draft steps) plus the tokens of this orchestrator's calls
to the same replica still in flight when it is sent (`begin` / `end`): a
batching replica serves them in the same forwards or ahead of it, so eight
sessions' catch-up feeds sent at once take about eight times one feed, and a
deadline learned at one session's load would call a busy replica hung.
"usual" is an EWMA per size bucket (powers of two) of the wall time of the
calls that answered, beside an EWMA of each sample's distance from it (a
shared, noisy machine answers at several times its usual latency now and
then without being hung: the deviation widens the deadline where the latency
is noisy, and costs nothing where it is steady). A size the replica has not
served yet is estimated from its neighbours (a larger bucket's time bounds a
smaller call's; a smaller one is scaled up by the ratio of sizes); a replica
with no answer at all yet borrows its peers' (the same role's median);
before anything of the role has answered, the deadline is `cold_s`. A call
that missed its deadline teaches nothing (its time is unknown), so a hang
never raises the deadline.

The same table answers "is this replica far slower than its peers for the
same work?" (orchestrator.fleet.outliers): `recent` is each bucket's EWMA from
calls within a window.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeadlinePolicy:
    """How deadlines follow measured latency (orchestrator flags --deadline-*)."""

    factor: float = 4.0  # x the usual wall time for the same size; 0 = no learned deadlines
    floor_ms: float = 300.0  # never shorter (scheduling hiccups, a GC pause)
    cold_s: float = 10.0  # before any call of the role has answered
    alpha: float = 0.3  # weight of a new sample in a bucket's EWMA

    @property
    def enabled(self) -> bool:
        return self.factor > 0


SPREAD = 2.0  # deviations over the usual wall time a deadline allows (before the factor)


def bucket_of(size: int) -> int:
    """Power-of-two size class: 1, 2-3, 4-7, ..."""
    return max(1, int(size)).bit_length()


@dataclass
class _Bucket:
    ms: float  # EWMA of the wall time
    size: float  # EWMA of the sizes it holds
    n: int = 1
    seen: float = 0.0  # monotonic time of the last sample
    dev: float = 0.0  # EWMA of |sample - ms| (taken before ms moves)

    def bound(self, spread: float) -> float:
        return self.ms + spread * self.dev


@dataclass
class ReplicaLatency:
    """One replica's wall times by size bucket."""

    alpha: float = 0.3
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def observe(self, size: int, ms: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        b = self.buckets.get(bucket_of(size))
        if b is None:
            self.buckets[bucket_of(size)] = _Bucket(ms, float(size), 1, now)
        else:
            b.dev += self.alpha * (abs(ms - b.ms) - b.dev)
            b.ms += self.alpha * (ms - b.ms)
            b.size += self.alpha * (size - b.size)
            b.n += 1
            b.seen = now

    def estimate_ms(self, size: int, spread: float = 0.0) -> float | None:
        """The usual wall time for `size` (plus `spread` of its deviations); None before any sample."""
        if not self.buckets:
            return None
        key = bucket_of(size)
        if key in self.buckets:
            return self.buckets[key].bound(spread)
        above = [k for k in self.buckets if k > key]
        if above:  # more work costs at least as much: a safe bound for less
            return self.buckets[min(above)].bound(spread)
        b = self.buckets[max(self.buckets)]
        return b.bound(spread) * max(1.0, size / max(b.size, 1.0))  # at most linear in the size


class LatencyBook:
    """Every replica's latency table in this orchestrator, by role and address."""

    def __init__(self, policy: DeadlinePolicy | None = None) -> None:
        self.policy = policy or DeadlinePolicy()
        self.replicas: dict[tuple[str, str], ReplicaLatency] = {}
        self.in_flight: dict[tuple[str, str], int] = {}  # tokens of calls sent and not yet answered

    def begin(self, role: str, address: str, size: int) -> int:
        """A call of `size` tokens is sent: the size its deadline and its latency are taken at
        (its own tokens and those already in flight to the replica). Pair with `end`."""
        key = (role, address)
        ahead = self.in_flight.get(key, 0)
        self.in_flight[key] = ahead + size
        return ahead + size

    def end(self, role: str, address: str, size: int) -> None:
        """The call of `size` tokens that `begin` counted is over (answered, failed or abandoned)."""
        key = (role, address)
        left = self.in_flight.get(key, 0) - size
        if left > 0:
            self.in_flight[key] = left
        else:
            self.in_flight.pop(key, None)

    def replica(self, role: str, address: str) -> ReplicaLatency:
        table = self.replicas.get((role, address))
        if table is None:
            table = self.replicas[(role, address)] = ReplicaLatency(alpha=self.policy.alpha)
        return table

    def observe(self, role: str, address: str, size: int, ms: float) -> None:
        self.replica(role, address).observe(size, ms)

    def usual_ms(self, role: str, address: str, size: int, spread: float = 0.0) -> float | None:
        """The replica's own estimate, else its peers' median, else None."""
        own = self.replicas.get((role, address))
        estimate = own.estimate_ms(size, spread) if own is not None else None
        if estimate is not None:
            return estimate
        peers = [e for (r, a), t in self.replicas.items() if r == role and a != address
                 if (e := t.estimate_ms(size, spread)) is not None]
        return statistics.median(peers) if peers else None

    def deadline_s(self, role: str, address: str, size: int) -> float | None:
        """The attempt's deadline in seconds; None when deadlines are off."""
        p = self.policy
        if not p.enabled:
            return None
        usual = self.usual_ms(role, address, size, SPREAD)
        if usual is None:
            return max(p.cold_s, p.floor_ms / 1e3)
        return max(p.floor_ms, p.factor * usual) / 1e3

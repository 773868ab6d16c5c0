"""What forwards cost on each replica, learned online from the services' ServerTiming.

The goodput-adaptive k (specdec.core.speedup.GoodputPolicy) needs, for the
replicas a session uses: the target's verify cost as a function of the tokens
in its forward, v(T); how many sessions share a target forward now; a draft
step's cost; and each call's cost beyond its forward. Every Score and Propose
reply carries the service's forward_ms and the batch that served it
(batch_rows, batch_tokens; 0 from a service that runs one request per forward).
`CostBook` keeps, per replica address:

  v(T)        an EWMA of forward_ms per token-count bucket (powers of two),
              interpolated piecewise-linearly (speedup.interpolate_cost); every
              session's calls feed it, target-only ones included
  rows        the load: sessions that would share a forward. At least an EWMA
              of batch_rows over recent Score calls; on a replica that batches,
              up to the sessions calling it now (capped by the most rows it has
              put in one forward), since sessions away drafting come back to it
  step_ms     a drafted token's latency at the draft: the call's server time
              (queueing included, on purpose: a busy draft is a stage every
              round waits for) / tokens drafted
  call_ms     an EWMA of rpc_ms - forward_ms: queueing, the RPC, (de)serializing
  queue_ms    an EWMA of a Score's server time beyond its forwards: the
              admission's saturation signal (orchestrator.policy.capacity)

and per draft replica the acceptance by position pooled over its sessions,
a new session's prior (speedup.PooledAcceptance).

The decision is made in the orchestrator, not the services: k needs the
session's acceptance by position (only the orchestrator verifies) and both
services' costs (each service sees only its own batch).

Where a round's time and bytes actually went is orchestrator.common.stats.Breakdown.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from orchestrator.policy.gate import SpeculationGate
from orchestrator.fleet.remote import Call
from specdec.core.speedup import PooledAcceptance, RoundCosts, interpolate_cost


STALE_HALFLIFE_S = 2.0  # a draft cost estimate this old weighs half against a new sample
CATCH_UP_TOKENS = 2  # committed tokens a Propose sends after a drafting round (the bonus, a last draft)


@dataclass
class _Ewma:
    alpha: float
    value: float = 0.0
    n: int = 0

    def add(self, x: float, weight: float | None = None) -> None:
        """A sample, with the EWMA's weight unless a larger one is given (an aged estimate)."""
        w = self.alpha if weight is None else max(self.alpha, weight)
        self.value = x if self.n == 0 else self.value + w * (x - self.value)
        self.n += 1


@dataclass
class ReplicaCosts:
    """One replica's measured costs (either role)."""

    alpha: float = 0.25  # weight of a new forward-cost sample
    load_alpha: float = 0.5  # weight of a new batch_rows sample: load changes fast
    buckets: dict[int, tuple[_Ewma, _Ewma]] = field(default_factory=dict)  # bucket -> (tokens, ms)
    rows: _Ewma = field(default_factory=lambda: _Ewma(0.5))
    step_ms: _Ewma = field(default_factory=lambda: _Ewma(0.25))
    call_ms: _Ewma = field(default_factory=lambda: _Ewma(0.25))
    peak_rows: float = 1.0  # the most rows seen in one forward, decaying
    gap_s: _Ewma = field(default_factory=lambda: _Ewma(0.25))  # a session's time between its calls
    queue_ms: _Ewma = field(default_factory=lambda: _Ewma(0.25))  # a Score's server time beyond its forwards
    forward_ms: _Ewma = field(default_factory=lambda: _Ewma(0.25))  # a Score's forwards' time
    row_tokens: _Ewma = field(default_factory=lambda: _Ewma(0.25))  # tokens one Score carries
    scored: float = 0.0  # monotonic time of the last Score observed
    proposed: float = 0.0  # monotonic time of the last Propose observed
    seen: dict[str, float] = field(default_factory=dict)  # session -> its last call (monotonic s)

    def __post_init__(self) -> None:
        self.rows.alpha = self.load_alpha
        self.step_ms.alpha = self.call_ms.alpha = self.alpha

    def observe_session(self, session: str, now: float | None = None) -> None:
        """`session` called this replica now: it counts towards the load for a few of its rounds."""
        now = time.monotonic() if now is None else now
        last = self.seen.get(session)
        if last is not None:
            self.gap_s.add(now - last)
        self.seen[session] = now

    def active(self, now: float | None = None) -> int:
        """Sessions that called within 3 of their usual gaps (at least 0.5 s)."""
        now = time.monotonic() if now is None else now
        window = max(0.5, 3.0 * self.gap_s.value)
        for session in [s for s, t in self.seen.items() if now - t > window]:
            del self.seen[session]
        return len(self.seen)

    def load_rows(self, now: float | None = None) -> float:
        return max(1.0, self.rows.value, min(float(self.active(now)), self.peak_rows))

    def observe_score(self, call: Call) -> None:
        """A Score call: its forward's cost at its forward's token count, and the load."""
        if call.batch_rows:
            self.peak_rows = max(float(call.batch_rows), 0.99 * self.peak_rows)
        if call.calls != 1 or call.forwards > 1 or call.forward_ms <= 0:
            return  # chunked prefill (several calls or forwards summed), or no forward time reported
        tokens = call.batch_tokens if call.batch_rows else call.tokens
        if tokens <= 0:
            return
        self.scored = time.monotonic()
        self.queue_ms.add(max(0.0, call.server_ms - call.forward_ms))
        self.forward_ms.add(call.forward_ms)
        self.row_tokens.add(call.tokens)
        bucket = int(tokens).bit_length()
        pair = self.buckets.get(bucket)
        if pair is None:
            pair = self.buckets[bucket] = (_Ewma(self.alpha), _Ewma(self.alpha))
        mean_tokens, ms = pair
        mean_tokens.add(tokens)
        ms.add(call.forward_ms)
        self.rows.add(max(1, call.batch_rows))
        self.call_ms.add(max(0.0, call.rpc_ms - call.forward_ms))

    def observe_propose(self, call: Call, drafted: int, now: float | None = None) -> None:
        """A Propose call that drafted `drafted` tokens: latency per drafted token, and the RPC's own.

        A call that also fed the draft a catch-up (more committed tokens than a drafting round
        leaves it short of: after k = 0 rounds, a probe) counts that feed as one step more, not
        as drafting cost. The draft's costs depend on its load (its queue counts on purpose), and
        they are only measured when someone drafts: a sample after a pause outweighs the old
        estimate by the pause (half of it after STALE_HALFLIFE_S), so a load that has gone does
        not keep making drafting look dear, and keep every session at k = 0, long after."""
        if call.calls != 1 or call.server_ms <= 0 or drafted <= 0:
            return
        now = time.monotonic() if now is None else now
        aged = 1.0 - 0.5 ** ((now - self.proposed) / STALE_HALFLIFE_S) if self.proposed else None
        self.proposed = now
        feeds = 1 if call.tokens > CATCH_UP_TOKENS else 0
        self.step_ms.add(call.server_ms / (drafted + feeds), aged)
        self.call_ms.add(max(0.0, call.rpc_ms - call.server_ms), aged)

    @property
    def measured(self) -> bool:
        return bool(self.buckets)

    def recent(self, within_s: float = 1.0) -> bool:
        """Whether a Score was observed within `within_s` (its load and queue figures are current)."""
        return bool(self.scored) and time.monotonic() - self.scored <= within_s

    def verify_ms(self, tokens: float) -> float:
        """v(T): a forward over `tokens` tokens, from the buckets (ValueError before any sample)."""
        return interpolate_cost([(t.value, ms.value) for t, ms in self.buckets.values()], tokens)

    def snapshot(self) -> dict:
        """For logs and benchmarks: the table as plain numbers."""
        return {
            "verify_ms": {round(t.value, 1): round(ms.value, 3) for t, ms in sorted(
                self.buckets.values(), key=lambda b: b[0].value)},
            "rows": round(self.rows.value, 2), "load_rows": round(self.load_rows(), 2), "step_ms": round(self.step_ms.value, 3),
            "call_ms": round(self.call_ms.value, 3),
        }


class CostBook:
    """Every replica's costs in this orchestrator process, by role and address."""

    def __init__(self) -> None:
        # Made on first use, once per key (a default built per call would be dropped on most).
        self.replicas: defaultdict[tuple[str, str], ReplicaCosts] = defaultdict(ReplicaCosts)
        self.pooled: defaultdict[str, PooledAcceptance] = defaultdict(PooledAcceptance)  # per draft replica
        self.gates: dict[str, SpeculationGate] = {}  # per target replica: does drafting pay (measured)

    def gate(self, target: str) -> SpeculationGate:
        gate = self.gates.get(target)
        if gate is None:
            gate = self.gates[target] = SpeculationGate(name=target)
        return gate

    def acceptance(self, draft: str) -> PooledAcceptance:
        """Acceptance by position pooled over the sessions drafting on `draft` (a new session's prior)."""
        return self.pooled[draft]

    def replica(self, role: str, address: str) -> ReplicaCosts:
        return self.replicas[(role, address)]

    def observe(self, role: str, address: str, call: Call | None, drafted: int = 0, session: str = "") -> None:
        if call is None:
            return
        costs = self.replica(role, address)
        if role == "target":
            if session:
                costs.observe_session(session)
            costs.observe_score(call)
        else:
            costs.observe_propose(call, drafted)

    def round_costs(self, target: str, draft: str | None) -> RoundCosts | None:
        """The inputs of one session's k decision; None until the target's cost was measured."""
        t = self.replicas.get(("target", target))
        if t is None or not t.measured:
            return None
        d = self.replicas.get(("draft", draft)) if draft else None
        if d is None or not d.step_ms.n:
            # No draft step measured yet: assume a step costs a tenth of a single-row verify.
            step, call = 0.1 * t.verify_ms(1), t.call_ms.value
        else:
            step, call = d.step_ms.value, d.call_ms.value
        return RoundCosts(verify_ms=t.verify_ms, rows=t.load_rows(), draft_step_ms=step,
                          draft_call_ms=call, round_ms=t.call_ms.value)

"""A generation's statistics: per-round figures, running totals, and their Stats message.

Each round is timed as a `RoundTally` (Stats.rounds): the services' compute,
the orchestrator's protobuf work, the network (the rest of the RPC time), the
time spent waiting on Redis, and the remainder. Rounds are contiguous: the
first starts with the request (it carries the session load and routing), each
ends once its chunk has been handed to the stream, so the rounds add up to the
request. The Redis write of round i overlaps round i+1's RPCs; only the part
round i+1 waits for counts as its Redis time, and the write's full duration is
kept apart (round i's redis_write_ms).
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field, fields

from orchestrator.common.calls import Call
from specdec.runtime import tracing
from specdec.core.verify import Verdict
from specdec.v1 import orchestrator_pb2 as pb


@dataclass
class Breakdown:
    """Where time and bytes went: the fields a round and a whole generation share
    (Stats and Stats.Round carry them under the same names)."""

    total_ms: float = 0.0
    draft_ms: float = 0.0  # draft service compute (server-side), on the critical path
    target_ms: float = 0.0  # target service compute (server-side)
    serialize_ms: float = 0.0
    network_ms: float = 0.0
    orchestrator_ms: float = 0.0  # the remainder: verify, bookkeeping, detokenise, stream, failed calls
    redis_ms: float = 0.0  # waited on Redis (not hidden behind RPCs)
    draft_hidden_ms: float = 0.0  # parallel: pre-draft compute hidden behind the target's verify
    bytes_sent: int = 0
    bytes_received: int = 0
    cache_misses: int = 0
    deadline_misses: int = 0  # model-service calls that missed their learned deadline
    feature_bytes: int = 0  # feature drafts: target features on the wire, Score replies + Propose requests


@functools.cache
def _round_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(RoundTally))


@dataclass
class RoundTally(Breakdown):
    """One round's figures; becomes a Stats.Round (field for field).

    draft + target + serialize + network + orchestrator + redis = total_ms.
    """

    k: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    redis_write_ms: float = 0.0  # this round's own write, start to ack (overlaps the next round)
    pre_drafted: bool = False  # parallel: drafts made during the previous round's verify
    pre_draft_discarded: bool = False  # parallel: a pre-draft was discarded, drafted anew
    source: str = ""  # what proposed the round's drafts ("draft", "lookup", "guess"; "" = none)
    tree: bool = False  # the drafts were a token tree (drafted: its size; accepted: the path's depth)
    accepted_ranks: list[int] = field(default_factory=list)  # each accepted token's rank among its siblings

    def as_dict(self) -> dict[str, int | float | bool | str]:
        """Every field by name: the Stats.Round message's fields, and the round span's attributes."""
        return {name: getattr(self, name) for name in _round_fields()}

    def add_proposal(self, proposal) -> None:
        """Book the round's proposal: its draft call, or the pre-draft it used (parallel mode).

        A pre-draft's compute overlapped the previous round's verify: only what this
        round still waited for it is draft_ms (on the critical path); the rest is
        draft_hidden_ms, outside total_ms. Its bytes did cross the wire.
        """
        self.add_call(proposal.call, "draft", proposal.cache_misses, proposal.deadline_misses)
        pre = getattr(proposal, "pre_draft", None)
        if pre is None:
            return
        self.pre_drafted = pre.hit
        self.pre_draft_discarded = not pre.hit
        if pre.hit:
            self.draft_ms += pre.waited_ms
            self.draft_hidden_ms += max(0.0, pre.call.server_ms - pre.waited_ms)
            self.bytes_sent += pre.call.bytes_sent
            self.bytes_received += pre.call.bytes_received

    def add_call(self, call: Call | None, role: str, cache_misses: int = 0, deadline_misses: int = 0) -> None:
        """Book one RPC (and the cache misses and missed deadlines on its way) to the draft or the target."""
        self.cache_misses += cache_misses
        self.deadline_misses += deadline_misses
        if call is None:
            return
        if role == "target":
            self.target_ms += call.server_ms
        else:
            self.draft_ms += call.server_ms
        self.serialize_ms += call.serialize_ms
        self.network_ms += call.network_ms
        self.bytes_sent += call.bytes_sent
        self.bytes_received += call.bytes_received


# Tally totals that are sums over its rounds.
_SUMMED = ("draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms",
           "bytes_sent", "bytes_received", "cache_misses", "draft_hidden_ms", "deadline_misses",
           "feature_bytes")


@dataclass
class Tally(Breakdown):
    """Running statistics of one generation; becomes the final Stats message.

    Every Stats field is an attribute or property of the same name here (a
    test checks), so `stats_to_proto` copies them by name.
    """

    session_id: str = ""
    finish_reason: str = ""
    proposer: str = ""
    fallback_reason: str = ""
    seed: int = 0
    target_replica: str = ""
    draft_replica: str = ""
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    draft_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)  # per draft position: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted it
    accepted_by_rank: list[int] = field(default_factory=list)  # accepted tokens by rank among siblings
    ttft_ms: float = 0.0
    index: int = 0  # the choice (GenerateRequest.n)
    rounds: list[RoundTally] = field(default_factory=list)
    # The request's clock (perf_counter seconds): when it started, when the open round started,
    # and the Redis wait booked before that round.
    started: float = field(default_factory=time.perf_counter, repr=False)
    _round_start: float = field(default=0.0, repr=False)
    _redis_before: float = field(default=0.0, repr=False)

    @property
    def round_started(self) -> float:
        """When the open round started (perf_counter seconds): the request's start, then the last
        close_round. A round's spans (specdec.runtime.tracing) start and end on these readings."""
        return self._round_start or self.started

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def accepted_prediction_tokens(self) -> int:
        return sum(r.accepted for r in self.rounds if r.source == "prediction")

    @property
    def rejected_prediction_tokens(self) -> int:
        return sum(r.drafted - r.accepted for r in self.rounds if r.source == "prediction")

    @property
    def pre_draft_hits(self) -> int:
        return sum(r.pre_drafted for r in self.rounds)

    @property
    def pre_draft_misses(self) -> int:
        return sum(r.pre_draft_discarded for r in self.rounds)

    @property
    def overhead_p50_ms(self) -> float:
        """Median over rounds of everything but the services' compute."""
        over = [r.total_ms - r.draft_ms - r.target_ms for r in self.rounds]
        return statistics.median(over) if over else 0.0

    def add_verdict(self, n_drafted: int, verdict: Verdict, depth: int | None = None) -> None:
        """A round's verdict on n_drafted tokens; a tree's positions are its depths (`depth`: the
        deepest), and its accepted tokens count by their rank among their siblings."""
        self.drafted_tokens += n_drafted
        self.accepted_tokens += verdict.accepted
        self.accepted_per_round.append(verdict.accepted)
        self.drafted_per_round.append(n_drafted)
        positions = n_drafted if depth is None else depth
        while len(self.drafted_at) < positions:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(positions):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < verdict.accepted
        for rank in getattr(verdict, "ranks", None) or [0] * verdict.accepted:
            while len(self.accepted_by_rank) <= rank:
                self.accepted_by_rank.append(0)
            self.accepted_by_rank[rank] += 1

    def chunk_sent(self) -> None:
        """A chunk is about to go out: the first one fixes the time to first token."""
        if not self.ttft_ms:
            self.ttft_ms = (time.perf_counter() - self.started) * 1e3

    def close_round(self, r: RoundTally) -> None:
        """End a round once its chunk is on the stream (the next starts now); totals are sums over rounds."""
        now = time.perf_counter()
        r.total_ms = (now - self.round_started) * 1e3
        r.redis_ms = self.redis_ms - self._redis_before
        r.orchestrator_ms = max(0.0, r.total_ms - r.draft_ms - r.target_ms
                                - r.serialize_ms - r.network_ms - r.redis_ms)
        self.rounds.append(r)
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(r, name))
        self._round_start, self._redis_before = now, self.redis_ms

    def finish(self) -> None:
        self.total_ms = (time.perf_counter() - self.started) * 1e3


class Timer:
    """Adds the elapsed milliseconds of a `with` block to an attribute of a Tally."""

    def __init__(self, tally: Tally, attr: str) -> None:
        self.tally, self.attr = tally, attr

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        self.ms = (end - self.start) * 1e3
        setattr(self.tally, self.attr, getattr(self.tally, self.attr) + self.ms)
        tracing.interval("redis wait" if self.attr == "redis_ms" else self.attr, self.start, end)


def stats_to_proto(t: Tally) -> pb.Stats:
    """The final Stats: every proto field read by name from the Tally, rounds field for field.

    Each round is filled in place (a Round built apart and passed in is copied) and only with
    its fields that are set (zero, False, "" and [] are the proto's own defaults): the message
    is built once per request, with every round in it."""
    stats = pb.Stats(**{name: getattr(t, name) for name in pb.Stats.DESCRIPTOR.fields_by_name if name != "rounds"})
    names = _round_fields()
    for r in t.rounds:
        out = stats.rounds.add()
        for name in names:
            if value := getattr(r, name):
                if name == "accepted_ranks":
                    out.accepted_ranks.extend(value)
                else:
                    setattr(out, name, value)
    return stats

"""Batch calls: one replica's Score (or Propose) calls of many sessions in one RPC.

Each session's loop still makes its own call (orchestrator.fleet.remote); a `CallBatcher` per
replica and method gathers the calls that arrive together and sends them as one ScoreBatch /
ProposeBatch, whose items the service queues at once, so they share its next forward pass. This
cuts the orchestrator's RPCs per token as sessions grow, and it keeps the sessions of one
orchestrator in step: the service sees one full batch instead of cohorts that keep missing each
other's forward.

When to send (the gathering policy): at once when every session this
orchestrator has live on the replica has a call waiting (calls made in the same
turn of the event loop go together; at one session every call goes at once,
with no wait), otherwise after a bounded wait:
`wait_fraction` of the batch RPC's measured time (a moving average), at most
`max_wait_s`. A late session joins the next batch. A session leaves the
replica's live set when its turn ends or it moves (`leave`), and in any case
once it has not called for STALE_S.

Sessions whose call is in flight count as coming: the replica runs one forward
at a time, so a call sent now would only queue behind that forward and then run
alone, and the sessions would settle into cohorts that alternate forwards
(half-full batches, each session waiting out the other cohort's forward). So
the waiting calls also wait for the in-flight batch to come back (its expected
end from the measured RPC time, at most one RPC time from now) plus the usual
bound, and its sessions join them in one batch: the cohorts merge.

Overlap (`overlap`, on by default): one batch a round leaves the replica idle while the
orchestrator works on the batch that came back. In two cohorts (a batch carries half the live
sessions) the replica computes one while the orchestrator works on the other, at the price of two
forwards a round. Which wins depends on what a forward's size costs (little on a GPU, in proportion
on a CPU), so the batcher measures the items a second under each choice in turn. A choice stands
for `probe_s` (doubled each time a trial confirms it, up to 8x; jittered so two batchers seldom
try at once; at once when the live sessions are a quarter more or fewer than at the last trial).
A trial: a window of the standing choice, a settling and a measured window of the other, a window
of the standing one again; the other is kept where it carried `MARGIN` more than both (void where
the live sessions moved).

The wire: a batch request is the items' own serialized bytes, each framed as
field 1 of the batch message (what protobuf writes for a repeated message
field), so nothing is encoded twice.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge

STALE_S = 2.0  # a session that has not called for this long no longer counts as live
EWMA = 0.2  # weight of the newest batch RPC time in its moving average
WINDOW = 8  # rounds per measured window (a round: one batch per cohort)
MARGIN = 1.05  # a trial's choice is kept when it carries this many times the items a second
BACKOFF = 8  # a confirmed choice's next trial waits at most this many times probe_s
STEADY = 0.1  # a window whose live sessions stay this close (a share) to its first count is steady
RELOAD = 0.25  # live sessions this far (a share) from those of the last trial: the next trial is due

log = logging.getLogger(__name__)

COHORTS = Gauge("specdec_batch_cohorts", "Cohorts a replica's batch calls run in (2: overlapped)",
                ["role", "address", "method"])
TRIALS = Counter("specdec_batch_overlap_trials_total", "Trials of the other cohort count, by outcome "
                 "(kept, held: the standing choice carried as much, void: the load moved)",
                 ["role", "method", "outcome"])


def frame(payload: bytes) -> bytes:
    """`payload` as one element of field 1 (length-delimited) of a message."""
    out = bytearray(b"\x0a")
    n = len(payload)
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + payload


class Late:
    """What a watched item's future holds once its deadline passed unanswered (`CallBatcher.watch`):
    `answer`, the future its answer still comes to."""

    __slots__ = ("answer",)

    def __init__(self, answer: asyncio.Future) -> None:
        self.answer = answer


@dataclass(slots=True)
class _Item:
    session_id: str
    payload: bytes
    submitted: float
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]
    deadline: float = 0.0  # time.monotonic() by which its caller wants an answer (watch)
    late: asyncio.Future | None = None  # where the answer goes once the caller was told Late


@dataclass
class _Window:
    """Items carried by the batches of a measuring window."""

    cohorts: int
    live: int
    started: float
    batches: int = 0
    items: int = 0
    steady: bool = True  # about as many sessions live throughout (STEADY)

    def rate(self, now: float) -> float:
        return self.items / max(now - self.started, 1e-9)


class Overlap:
    """One cohort or two, chosen by trying both (see Overlap in the module docstring)."""

    def __init__(self, role: str = "", address: str = "", method: str = "", probe_s: float = 2.0) -> None:
        self.role, self.method, self.probe_s = role, method, probe_s
        self.name = f"{role} {address} {method}"  # for the log
        self._gauge = COHORTS.labels(role, address, method)
        self._gauge.set(1)
        self.cohorts = 1
        self._wait_s = probe_s  # until the next trial (doubles while trials confirm the choice)
        self._next = time.monotonic() + self._jitter()
        self._window: _Window | None = None
        self._phase = ""  # "" standing; a trial: "settle", "trial" (the other choice), "after" (back)
        self._rates: list[float] = []  # a trial's measured windows: before, trial, after
        self._live = 0  # live sessions at the trial's start (-1: a window of it was not steady)
        self._tried_live = 0  # live sessions at the last trial

    @property
    def standing(self) -> int:
        """The choice in force outside a trial."""
        return 3 - self.cohorts if self._phase in ("settle", "trial") else self.cohorts

    def _jitter(self) -> float:
        return self._wait_s * random.uniform(0.75, 1.25)

    def batch_done(self, items: int, live: int) -> None:
        """A batch came back carrying `items` with `live` sessions live on the replica."""
        now = time.monotonic()
        w = self._window
        if w is None:
            self._window = _Window(self.cohorts, live, now)
            return
        w.batches += 1
        w.items += items
        w.steady = w.steady and abs(live - w.live) <= STEADY * w.live
        if w.batches < WINDOW * w.cohorts:
            return
        if self._phase and (not w.steady or abs(live - self._live) > STEADY * self._live):
            self._live = -1  # the load moved under the trial: it is void
        if self._phase == "settle":
            self._phase = "trial"
        elif self._phase == "trial":
            self._rates.append(w.rate(now))
            self.cohorts, self._phase = 3 - self.cohorts, "after"
        elif self._phase == "after":
            self._rates.append(w.rate(now))
            self._decide(live)
        elif live > 1 and w.steady and (now >= self._next or abs(live - self._tried_live) > RELOAD * live):
            self._rates, self._live = [w.rate(now)], live
            self.cohorts, self._phase = 3 - self.cohorts, "settle"
        self._window = _Window(self.cohorts, live, now)

    def _decide(self, live: int) -> None:
        """The trial's choice is kept where it carried MARGIN more than the standing one both
        before and after it (the load may drift meanwhile)."""
        (before, tried_rate, after), tried = self._rates, 3 - self.cohorts
        void = self._live < 0
        keep = not void and tried_rate > MARGIN * max(before, after)
        self._phase, self._tried_live = "", live
        TRIALS.labels(self.role, self.method, "void" if void else "kept" if keep else "held").inc()
        if keep:
            self.cohorts = tried
            self._gauge.set(tried)
        if keep or void:
            self._wait_s = self.probe_s
        else:  # the standing choice held: try again later
            self._wait_s = min(self._wait_s * 2, self.probe_s * BACKOFF)
        self._next = time.monotonic() + self._jitter()
        if keep:
            log.info("%s: %s (%.0f items/s against %.0f before and %.0f after)", self.name,
                     "two cohorts" if tried == 2 else "one cohort", tried_rate, before, after)


# send(items) -> per item (response message, or an exception), plus the RPC's own seconds
SendBatch = Callable[[list[_Item]], Awaitable[list[Any]]]


class CallBatcher:
    """Gathers calls to one replica's method; see the module docstring."""

    def __init__(self, send: SendBatch, *, max_items: int = 64, max_wait_s: float = 0.02,
                 wait_fraction: float = 0.5, overlap: Overlap | None = None):
        self._send = send
        self.overlap = overlap
        self.max_items = max(1, max_items)
        self.max_wait_s = max(0.0, max_wait_s)
        self.wait_fraction = wait_fraction
        self._pending: list[_Item] = []
        self._live: dict[str, float] = {}  # session id -> when it last called
        self._in_flight: dict[str, float] = {}  # session id -> when its call was sent
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._soon = False  # the scheduled flush is for the next turn of the loop
        self._rpc_s = 0.0  # moving average of a batch RPC's time
        self._watched: list[_Item] = []  # items with a deadline (watch), pruned as the timer fires
        self._watch_timer: asyncio.TimerHandle | None = None
        self._watch_at = math.inf  # when the watch timer fires
        self.batches = 0
        self.items = 0

    @property
    def wait_s(self) -> float:
        return min(self.max_wait_s, self.wait_fraction * self._rpc_s)

    def leave(self, session_id: str) -> None:
        """The session has no more calls for this replica (its turn ended, or it moved)."""
        self._live.pop(session_id, None)
        if self._pending and self._ready():
            self._schedule(asyncio.get_running_loop(), 0.0)

    def _sweep(self) -> None:
        """Forget sessions that stopped calling without a leave (a crashed turn, say)."""
        now = time.monotonic()
        for sid, seen in list(self._live.items()):
            if now - seen > STALE_S and sid not in self._in_flight:
                del self._live[sid]

    @property
    def cohorts(self) -> int:
        return self.overlap.cohorts if self.overlap is not None else 1

    def _size(self) -> int:
        """Items a batch carries: every live session, or (two cohorts) half of them."""
        need = min(self.max_items, max(1, len(self._live)))
        return math.ceil(need / 2) if self.cohorts == 2 else need

    def _ready(self) -> bool:
        # Every live session: those in flight are coming back (see the module docstring).
        return len(self._pending) >= self._size()

    def _delay(self) -> float:
        """How long pending calls wait for the live sessions that have none pending."""
        if not self._in_flight or not self._rpc_s:
            return self.wait_s
        back = max(self._in_flight.values()) + self._rpc_s - time.perf_counter()
        return min(max(0.0, back), self._rpc_s) + self.wait_s

    async def call(self, session_id: str, payload: bytes) -> Any:
        """The item's response message (raises its error); sent in the next batch."""
        return await self.submit(session_id, payload)

    def submit(self, session_id: str, payload: bytes) -> asyncio.Future:
        """`call` without its coroutine: the future of the item's response, sent in the next batch."""
        return self.submit_item(session_id, payload).future

    def submit_item(self, session_id: str, payload: bytes) -> _Item:
        """`submit`, answering the item itself (its future; `watch` takes it)."""
        loop = asyncio.get_running_loop()
        item = _Item(session_id, payload, time.perf_counter(), loop.create_future())
        self._live[session_id] = time.monotonic()
        self._pending.append(item)
        if self._ready():
            # Soon, not now: calls made in the same turn of the event loop go together.
            self._schedule(loop, 0.0)
        else:
            self._schedule(loop, self._delay())
        return item

    def watch(self, item: _Item, deadline: float) -> None:
        """Wake the item's caller at `deadline` (time.monotonic()) if no answer came by then: its
        future then holds `Late`, whose `answer` gets the answer when it comes. One timer for all
        the watched items of this replica, not one per call: every session's every round is
        watched (orchestrator.fleet.remote's learned deadlines)."""
        item.deadline = deadline
        self._watched.append(item)
        if deadline < self._watch_at:
            self._arm(deadline)

    def _arm(self, at: float) -> None:
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        self._watch_at = at
        self._watch_timer = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self._expire)

    def _expire(self) -> None:
        """The watch timer: overdue items' callers are told Late; the answered ones are forgotten."""
        self._watch_timer, self._watch_at = None, math.inf
        now, kept, earliest = time.monotonic(), [], math.inf
        for item in self._watched:
            if item.future.done():
                continue
            if item.deadline <= now:
                item.late = item.future.get_loop().create_future()
                item.future.set_result(Late(item.late))
            else:
                kept.append(item)
                earliest = min(earliest, item.deadline)
        self._watched = kept
        if kept:
            self._arm(earliest)

    def _schedule(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        if self._timer is not None:
            if delay > 0 or self._soon:
                return
            self._timer.cancel()
        self._soon = delay == 0
        self._timer = loop.call_soon(self._flush) if self._soon else loop.call_later(delay, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            if not self._soon:  # the wait ran out: maybe someone has gone for good
                self._sweep()
            self._timer.cancel()
            self._timer = None
        size = self._size() if self.cohorts == 2 else self.max_items
        while self._pending:
            items, self._pending = self._pending[:size], self._pending[size:]
            sent = time.perf_counter()
            self._in_flight.update((item.session_id, sent) for item in items)
            asyncio.get_running_loop().create_task(self._run(items))

    async def _run(self, items: list[_Item]) -> None:
        started = time.perf_counter()
        try:
            outcomes = await self._send(items)
        except asyncio.CancelledError:  # shutting down: every caller is cancelled too
            for item in items:
                self._in_flight.pop(item.session_id, None)
                item.future.cancel()
            raise
        except Exception as exc:  # the whole RPC failed: every item shares its error
            outcomes = [exc] * len(items)
        self._rpc_s = (1 - EWMA) * self._rpc_s + EWMA * (time.perf_counter() - started)
        self.batches += 1
        self.items += len(items)
        try:
            self._resolve(items, outcomes)
        finally:
            if self.overlap is not None:  # after the callers have their answers, whatever it does
                self.overlap.batch_done(len(items), len(self._live))

    def _resolve(self, items: list[_Item], outcomes: list[Any]) -> None:
        for item, outcome in zip(items, outcomes):
            self._in_flight.pop(item.session_id, None)
            future = item.future if item.late is None else item.late  # told Late: the answer goes on
            if future.done():
                continue  # its caller was cancelled
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

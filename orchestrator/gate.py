"""Does drafting pay on this target replica right now? Measured online, not modelled.

The goodput model (specdec.core.speedup) predicts each session's best k from
its acceptance and the costs measured per replica, treating the sessions in a
forward as alike. Under load it can be wrong in ways only a measurement
shows. So for the requests that leave the choice to the orchestrator (no k in
the request: the default proposer, adaptive k), a `SpeculationGate` per
target replica compares what matters directly: committed tokens per second on
that replica, from this orchestrator's sessions, in epochs with drafting
allowed and in epochs with every such session at k = 0.

Each epoch (EPOCH_S) runs one mode for every gated session on the replica.
An epoch's rate is what its slowest session committed in its decoding rounds
over the time they took (its tokens over the sum of its rounds' wall times),
times the sessions live: the rate at which the replica finishes equal work
for all of them, which is what a load of equal requests waits for. Summing
the sessions' rates instead measured drafting ahead at two sessions (86.7
against 74.7 tokens/s) where the cells measured it behind (0.84x
target-only): drafting made the two streams uneven, one ran at 47-55
tokens/s on a text the draft guessed well, the other at 32-35 against 34-38
for both under target-only (its rounds waited on the first's wider verify
forwards instead of sharing one), and the request ended with the slower. So
drafting is chosen only where it leaves even its slowest session faster than
plain decoding leaves them all. Only sessions with MIN_ROUNDS rounds in the
epoch are compared (one round's tokens are too lumpy to rank); with none, the
epoch is scored on all its rounds pooled. A request's first round (its
prompt's prefill, the same in either mode) is not counted, nor is the time
between rounds (a client reading, a replica sitting idle): a one-second
epoch that held a 300 ms prefill would otherwise score its mode at half its
speed, and a single request's first epochs would decide against drafting on
the prefill alone. The rates are
kept per load level (how many gated sessions were live: 1, 2, 3-4, 5-8,
9-16, ...), as a moving average per mode. The chosen mode's epochs enter it
clipped to within CLIP of the average: a single freak epoch (a replica
stalled for a second on a shared machine) must not flip a verdict, while a
real change still moves the average a tenth per epoch (and the chosen mode
is measured every epoch); the explored mode's rare epochs enter unclipped,
so a text that got easy is found at the next exploration. At a load level
where one mode has no measurement yet, that mode runs next (an epoch during
which the load level changed, or the replica sat idle, is not scored);
otherwise the better one runs, and one epoch in EXPLORE_EVERY measures the
other one again, so the choice follows the load and the text. Each
exploration that leaves the verdict as it was doubles the wait before the
next (up to EXPLORE_MAX), and a changed verdict starts it over: a steady
load pays little for measuring the mode it does not run. Such an epoch (one
whose mode is not its level's verdict, measured or presumed) also lasts only
EXPLORE_FRACTION of an epoch: at 8 sessions the default proposer's cells that
held an exploration ran at 60-61 tokens/s and the others at 67, against 61-67
for target-only. Drafting must beat plain decoding by MARGIN to be chosen:
switching has costs an epoch's rate
does not show (each session's first draft call after plain epochs feeds the
draft what it missed; drafting's extra processes slow a shared CPU's other
work), and one-second rates on a shared machine are noisy, so a draft that
only ties loses to no drafting. Where drafting pays (a light load) it pays
by far more than the margin.

A load level seen for the first time borrows its neighbours' verdicts, since
drafting's gain shrinks as a replica's batches grow: where a lower level
measured plain decoding better, the new level starts with plain decoding and
measures drafting only at its first exploration (and where a higher level
measured drafting better, the other way round). So does a level whose nearest
lower level measured drafting ahead by less than PRESUME_LEAD: a small lead
rarely survives a doubling of the load (on this project's CPU the default
proposer measured 1.66x target-only alone, 1.11x at two sessions, 0.95x at
four). A ramp of load then does not pay a losing epoch at every level it
climbs through.

An epoch's level is the load at its first decoding round, not at its start:
the first request of a burst starts an epoch at one live session, and the
others join it with their prefills before any decoding round; scored at one
session, such an epoch was dropped when it closed at the burst's level, and a
load of two sessions lasting two seconds never had a verdict of its own.

When the load rises past the running epoch's level to one whose verdict is
the other mode, the epoch ends there (unscored) and the new level's runs: a
burst of requests arriving while one session's "drafting" epoch runs would
otherwise all feed the draft their prompts and draft for up to an epoch at a
load where drafting measured slower. A fall in load waits for the epoch's end:
the sessions still running are mid-stream, and drafting for them first costs
the draft a catch-up feed of everything it missed.

The gate only ever takes the draft model away; what k a drafting round uses
stays the goodput model's choice. A plain epoch is k = 0 for every proposer,
with one exception: a lone session (one live on the replica) whose proposer
has free guesses (combined) still proposes a prompt-lookup guess there when
the goodput model says it beats k = 0 by itself; at one row that model is
exact and a guess costs no draft call. The demo's default prompt drafted
three rounds, all rejected, and its plain epoch then sent nothing while the
text repeated itself (lookup alone measured 1.15x target-only on it). Under
load a plain epoch stays target-only rounds, the baseline the gate compares
against: with lookup guesses kept there at every load, the default proposer
measured 0.84-0.85x target-only at 4 sessions and 0.88-0.89x at 8 in two load
runs, against 0.91x and 0.99x without (benchmarks.load, 64 tokens).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

EPOCH_S = 1.0
EXPLORE_EVERY = 8  # one epoch in this many measures the mode that is not chosen
EXPLORE_MAX = 32  # ... one in this many at most, doubling while explorations confirm the verdict
MARGIN = 0.10  # drafting must beat plain decoding by this to be chosen
PRESUME_LEAD = 0.25  # a lower level's drafting lead below this presumes plain decoding above it
EWMA = 0.3  # weight of the newest epoch's rate
CLIP = 1.5  # an epoch's rate enters the average within [average / CLIP, average x CLIP]
MIN_ROUNDS = 3  # a session's rate is compared once it has this many rounds in the epoch
STALE_FACTOR = 3.0  # an epoch this many times its length saw an idle replica: not scored
EXPLORE_FRACTION = 0.5  # an epoch running the mode its level's verdict does not: this share of EPOCH_S


def load_level(live: int) -> int:
    """1 (one session), 2 (two), 3 (3-4), 4 (5-8), 5 (9-16), ...: up to the next power of two."""
    return (max(1, live) - 1).bit_length() + 1


@dataclass
class _Rates:
    spec: float | None = None  # tokens/s with drafting allowed
    plain: float | None = None  # tokens/s with k = 0
    epochs: int = 0
    choice: bool | None = None  # the mode last chosen on the measurements (not an exploring epoch)
    wait: int = EXPLORE_EVERY  # one epoch in this many explores
    run: int = 0  # epochs of the chosen mode since the last exploration
    explored: bool = False  # the last epoch picked here measured the mode not chosen


@dataclass
class SpeculationGate:
    """One target replica's: see the module docstring."""

    name: str = ""  # the target replica's address, for the log
    epoch_s: float = EPOCH_S
    explore_every: int = EXPLORE_EVERY
    explore_max: int = EXPLORE_MAX
    margin: float = MARGIN
    levels: dict[int, _Rates] = field(default_factory=dict)
    live: int = 0  # gated sessions running on the replica now
    mode_spec: bool = True  # the mode of the running epoch
    _epoch_start: float = 0.0
    _epoch_len: float = EPOCH_S  # the running epoch's length (shorter for an exploration)
    _epoch_rounds: int = 0
    _epoch_live: int = 0  # the live sessions summed over the recorded rounds (their mean: concurrency)
    _epoch_level: int = 1
    _epoch_sessions: dict = field(default_factory=dict)  # session -> [tokens, round seconds, rounds]
    flips: int = 0
    rounds: int = 0  # decoding rounds recorded, in all

    def enter(self) -> None:
        self.live += 1

    def leave(self) -> None:
        self.live = max(0, self.live - 1)

    def allows(self, now: float | None = None) -> bool:
        """Whether a gated session may draft this round (ends and starts epochs as time passes)."""
        now = time.monotonic() if now is None else now
        if not self._epoch_start:
            self._start(now, self.mode_spec)
        elif now - self._epoch_start >= self._epoch_len:
            self._close(now)
        elif self._surged():
            self._start_next(now)  # the epoch is dropped unscored: its load level is gone
        return self.mode_spec

    def _verdict(self, level: int) -> bool | None:
        """The mode this load level would run, as measured (or presumed from its neighbours)."""
        rates = self.levels.get(level)
        if rates is not None and rates.choice is not None:
            return rates.choice
        return self._presumed(level)

    def _surged(self) -> bool:
        """Whether the load rose past the running epoch's level to one whose verdict is the other
        mode: a burst of requests arriving in an epoch that one session's verdict started."""
        level = load_level(self.live)
        if level <= self._epoch_level:
            return False
        verdict = self._verdict(level)
        return verdict is not None and verdict != self.mode_spec

    def record(self, tokens: int, seconds: float, session: object = None) -> None:
        """A gated session's decoding round: the tokens it committed and its wall time (rounds
        recorded without a session are pooled, as one)."""
        if not self._epoch_rounds:
            # The epoch's level is the load of its first decoding round, not of its start: a
            # burst's first arrival starts an epoch at one live session, and the others join it
            # with their prefills (not recorded) before any round is; scored at one session, the
            # epoch would be dropped as soon as it closed at the burst's level.
            self._epoch_level = load_level(self.live)
        self._epoch_rounds += 1
        self._epoch_live += max(self.live, 1)
        self.rounds += 1
        own = self._epoch_sessions.setdefault(session, [0, 0.0, 0])
        own[0] += tokens
        own[1] += max(seconds, 0.0)
        own[2] += 1

    def _start(self, now: float, spec: bool, exploring: bool = False) -> None:
        self.flips += spec != self.mode_spec
        self.mode_spec, self._epoch_start = spec, now
        self._epoch_len = self.epoch_s * (EXPLORE_FRACTION if exploring else 1.0)
        self._epoch_rounds, self._epoch_live = 0, 0
        self._epoch_sessions = {}
        self._epoch_level = load_level(self.live)

    def _rate(self) -> float | None:
        """The running epoch's replica rate in tokens/s: its slowest session's rate (of those with
        MIN_ROUNDS rounds; else all rounds pooled) times the sessions live (None: no round took
        any time)."""
        tallies = self._epoch_sessions.values()
        pooled_s = sum(s for _, s, _ in tallies)
        if pooled_s <= 0:
            return None
        rates = [t / s for t, s, n in tallies if n >= MIN_ROUNDS and s > 0]
        per_session = min(rates) if rates else sum(t for t, _, _ in tallies) / pooled_s
        return per_session * (self._epoch_live / self._epoch_rounds)

    def _close(self, now: float) -> None:
        """Score the epoch that ends now, then pick the next one's mode.

        An epoch is not scored if the load level changed during it, if it ran
        far past its length (nobody asked for a round: an idle replica), or if
        no decoding round of it was recorded."""
        level = load_level(self.live)
        duration = now - self._epoch_start
        rate = self._rate()
        if level == self._epoch_level and duration <= STALE_FACTOR * self._epoch_len and rate is not None:
            rates = self.levels.setdefault(level, _Rates())
            name = "spec" if self.mode_spec else "plain"
            old = getattr(rates, name)
            if old is not None and rates.choice is self.mode_spec:
                # The chosen mode, measured every epoch: one freak epoch (a stalled replica) moves it
                # a little. The other one, measured by rare explorations, moves freely.
                rate = (1 - EWMA) * old + EWMA * min(max(rate, old / CLIP), old * CLIP)
            elif old is not None:
                rate = (1 - EWMA) * old + EWMA * rate
            setattr(rates, name, rate)
            rates.epochs += 1
        self._start_next(now)

    def _start_next(self, now: float) -> None:
        """Start an epoch in the mode the load level now live calls for."""
        level = load_level(self.live)
        spec = self._next(self.levels.setdefault(level, _Rates()), level)
        verdict = self._verdict(level)
        self._start(now, spec, exploring=verdict is not None and spec != verdict)

    def _presumed(self, level: int) -> bool | None:
        """What the neighbouring levels' verdicts imply here: False where a lower level chose plain
        decoding (or the nearest lower level measured drafting ahead by less than PRESUME_LEAD),
        True where a higher one chose drafting, else (or both) None."""
        plain_below = any(r.choice is False for lv, r in self.levels.items() if lv < level)
        spec_above = any(r.choice is True for lv, r in self.levels.items() if lv > level)
        if not plain_below and not spec_above:
            measured = [lv for lv, r in self.levels.items() if lv < level and r.spec and r.plain]
            if measured:  # the nearest lower level's lead, if small, will not survive more load
                r = self.levels[max(measured)]
                plain_below = r.spec < r.plain * (1 + PRESUME_LEAD)
        return None if plain_below == spec_above else spec_above

    def _explore(self, rates: _Rates) -> bool:
        """Whether the next epoch at this level measures the mode not chosen (counting the run)."""
        if rates.run + 1 >= rates.wait:
            rates.run, rates.explored = 0, True
            return True
        rates.run += 1
        return False

    def _next(self, rates: _Rates, level: int = 1) -> bool:
        """The next epoch's mode at this load level."""
        if rates.spec is None or rates.plain is None:
            presumed = self._presumed(level)
            measured_spec = rates.spec is not None
            if rates.spec is None and rates.plain is None:
                return presumed is not False  # drafting first, unless a lower level chose plain
            if presumed is measured_spec and not self._explore(rates):
                return measured_spec  # the neighbours' verdict stands until the first exploration
            return not measured_spec
        best_spec = rates.spec > rates.plain * (1 + self.margin)
        if rates.explored:  # the exploration just scored: a verdict it confirms waits longer
            rates.explored = False
            if best_spec == rates.choice:
                rates.wait = min(2 * rates.wait, self.explore_max)
        if best_spec != rates.choice:
            rates.choice, rates.wait, rates.run = best_spec, self.explore_every, 0
            low = 1 if level == 1 else 2 ** (level - 2) + 1
            log.info("target %s, %s live session(s): %s (measured %.1f tokens/s drafting, %.1f without)",
                     self.name or "?", low if low == 2 ** (level - 1) else f"{low}-{2 ** (level - 1)}",
                     "drafting" if best_spec else "no drafting (k = 0)", rates.spec, rates.plain)
        return not best_spec if self._explore(rates) else best_spec

    def snapshot(self) -> dict:
        return {level: (r.spec, r.plain, r.epochs) for level, r in sorted(self.levels.items())}

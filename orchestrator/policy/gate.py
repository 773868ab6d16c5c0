"""Does drafting pay on this target replica right now? Measured online, not modelled.

The goodput model (specdec.core.speedup) predicts each session's best k, treating
the sessions in a forward as alike; under load it can be wrong in ways only a
measurement shows. So for the requests that leave the choice to the orchestrator
(no k: the default proposer, adaptive k), a `SpeculationGate` per target replica
compares committed tokens per second on that replica in epochs with drafting
allowed and in epochs with every such session at k = 0.

  * An epoch (EPOCH_S) runs one mode for every gated session, and at least
    MIN_EPOCH_ROUNDS decoding rounds: on a slow replica, or when a request starts
    late in an epoch, it runs on until it has them (a verdict on a lone session's
    two or three rounds is noise), but not past STALE_FACTOR times its length.
    Its rate is its slowest session's tokens over its decoding rounds' wall time
    (sessions with MIN_ROUNDS rounds; else all rounds pooled), times the sessions
    live. First rounds (prefill) and the time between rounds are not counted.
  * Rates are kept per load level (1, 2, 3-4, 5-8, ... live sessions; see
    load_level) as a moving average per mode. The chosen mode's epochs enter
    clipped to within CLIP of it, so one freak epoch cannot flip a verdict.
  * Drafting must beat plain decoding by MARGIN. A level with a mode unmeasured
    runs it next; otherwise one epoch in EXPLORE_EVERY (doubling up to
    EXPLORE_MAX while the verdict holds) measures the other mode, for only
    EXPLORE_FRACTION of an epoch.
  * A level seen for the first time borrows its neighbours' verdicts (plain above
    a level where plain won, or drafting led by under PRESUME_LEAD).
  * An epoch runs the mode of the level live when it starts, and starts again
    for the level live now as long as none of its decoding rounds has run: a
    burst's first arrival starts it at one session, its rounds run at the
    burst's level. Its level is that of its first decoding round, and it is
    scored there if its rounds ran at that level on the whole (their mean live
    sessions): not a load that moved to another level, nor an epoch that saw an
    idle replica, but a burst that drained and started again (it closes at the
    next burst's first round, one session live). A rise in load to a level
    whose verdict is the other mode ends the epoch at once.

The gate only takes the draft model away; the k of a drafting round stays the
goodput model's. A plain epoch is k = 0 for every proposer, except that a lone
session's proposer with free guesses (combined) keeps the lookup guesses that
pay (orchestrator.round.loop). Why each rule exists: docs/benchmark-history.md,
"The speculation gate's design notes", and docs/architecture.md, "Choosing k".
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
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
MIN_EPOCH_ROUNDS = 8  # an epoch is scored once it has this many decoding rounds (all sessions')
STALE_FACTOR = 3.0  # an epoch this many times its length saw an idle replica: not scored
EXPLORE_FRACTION = 0.5  # an epoch running the mode its level's verdict does not: this share of EPOCH_S


def _tally() -> list:
    """A session's figures in an epoch: [tokens, round seconds, rounds]."""
    return [0, 0.0, 0]


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
    min_rounds: int = MIN_EPOCH_ROUNDS
    levels: dict[int, _Rates] = field(default_factory=dict)
    live: int = 0  # gated sessions running on the replica now
    mode_spec: bool = True  # the mode of the running epoch
    _epoch_start: float = 0.0
    _epoch_len: float = EPOCH_S  # the running epoch's length (shorter for an exploration)
    _epoch_rounds: int = 0
    _epoch_live: int = 0  # the live sessions summed over the recorded rounds (their mean: concurrency)
    _epoch_level: int = 1
    _picked_level: int = 1  # the load level whose mode the running epoch runs (live at its start)
    _epoch_sessions: defaultdict = field(default_factory=lambda: defaultdict(_tally))  # session -> _tally()
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
        elif self._due(now - self._epoch_start):
            self._close(now)
        elif self._surged():
            self._start_next(now)  # the epoch is dropped unscored: its load level is gone
        elif not self._epoch_rounds and load_level(self.live) != self._picked_level:
            self._start_next(now)  # no decoding round yet: the mode is the level's that will run them
        return self.mode_spec

    def _due(self, elapsed: float) -> bool:
        """Whether the running epoch ends now: its length is up and it holds enough rounds to be
        scored, or none (nothing to wait for), or it ran so far past its length that it will not
        be scored (an idle replica)."""
        if elapsed < self._epoch_len:
            return False
        return (self._epoch_rounds >= self.min_rounds or not self._epoch_rounds
                or elapsed > STALE_FACTOR * self._epoch_len)

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
        own = self._epoch_sessions[session]
        own[0] += tokens
        own[1] += max(seconds, 0.0)
        own[2] += 1

    def _start(self, now: float, spec: bool, exploring: bool = False) -> None:
        self.flips += spec != self.mode_spec
        self.mode_spec, self._epoch_start = spec, now
        self._epoch_len = self.epoch_s * (EXPLORE_FRACTION if exploring else 1.0)
        self._epoch_rounds, self._epoch_live = 0, 0
        self._epoch_sessions = defaultdict(_tally)
        self._epoch_level = self._picked_level = load_level(self.live)

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

        An epoch is not scored if its rounds ran at another load level than its
        first one's (their mean live sessions), if it ran far past its length
        (nobody asked for a round: an idle replica), or if no decoding round of
        it was recorded. The live sessions now do not count: a burst's epoch
        closes when the next burst's first session asks for a round."""
        level = self._epoch_level
        duration = now - self._epoch_start
        rate = self._rate()
        held = self._epoch_rounds and load_level(round(self._epoch_live / self._epoch_rounds)) == level
        if held and duration <= STALE_FACTOR * self._epoch_len and rate is not None:
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

"""A pass quota per visitor: target passes (not requests) in a sliding window.

The playground lets a visitor spend at most `per_window` target passes in any `window_s`
seconds (30 per minute by default). A request reserves what it may need before it starts
(a generation: up to its max_new_tokens, and the orchestrator is told to stop after the
passes granted), then settles what it really used; the rest goes back at once. So the
31st pass of a minute is never run: it is refused before the forward, with a message
saying when passes free up. A run served from the playground's cache settles 0.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


_PRUNE_AT = 4096  # visitors remembered before idle ones are dropped


class QuotaExhausted(Exception):
    """No pass left for this visitor now; `retry_after_s` until the oldest one leaves the window."""

    def __init__(self, per_window: int, window_s: float, retry_after_s: float) -> None:
        self.per_window, self.window_s = per_window, window_s
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        super().__init__(
            f"Pass quota reached: {per_window} target passes per {_span(window_s)} per visitor. "
            f"The next pass frees up in {self.retry_after_s} s; a run you repeat comes from the "
            "cache and costs nothing.")


def _span(window_s: float) -> str:
    return "minute" if window_s == 60 else f"{window_s:g} s"


@dataclass
class _Visitor:
    spent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, passes), oldest first
    reserved: int = 0

    def used(self, now: float, window_s: float) -> int:
        while self.spent and self.spent[0][0] <= now - window_s:
            self.spent.popleft()
        return sum(n for _, n in self.spent)


class Reservation:
    """Passes set aside for one request; `settle(used)` books what it used and frees the rest."""

    def __init__(self, quota: PassQuota, visitor: str, granted: int) -> None:
        self._quota, self._visitor, self.granted = quota, visitor, granted
        self._open = True

    def settle(self, used: int) -> None:
        if self._open:
            self._open = False
            self._quota._settle(self._visitor, self.granted, min(max(used, 0), self.granted))


class PassQuota:
    """Target passes per visitor per sliding window (0 passes per window = no quota)."""

    def __init__(self, per_window: int = 30, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if per_window < 0 or window_s <= 0:
            raise ValueError(f"need per_window >= 0 and window_s > 0, got {per_window}, {window_s}")
        self.per_window, self.window_s, self._clock = per_window, window_s, clock
        self._visitors: dict[str, _Visitor] = {}

    @property
    def unlimited(self) -> bool:
        return self.per_window == 0

    def remaining(self, visitor: str) -> int:
        """Passes this visitor could reserve now."""
        if self.unlimited:
            return 2**31 - 1
        v = self._visitors.get(visitor)
        if v is None:
            return self.per_window
        return max(0, self.per_window - v.used(self._clock(), self.window_s) - v.reserved)

    def reset_in(self, visitor: str) -> float:
        """Seconds until this visitor's oldest counted pass leaves the window (0 if none)."""
        v = self._visitors.get(visitor)
        if v is None or not v.spent:
            return 0.0
        return max(0.0, v.spent[0][0] + self.window_s - self._clock())

    def reserve(self, visitor: str, wanted: int) -> Reservation:
        """Up to `wanted` passes (at least 1 is needed), or QuotaExhausted."""
        if wanted < 1:
            raise ValueError(f"wanted must be >= 1, got {wanted}")
        if self.unlimited:
            return Reservation(self, visitor, wanted)
        if len(self._visitors) > _PRUNE_AT:
            self._prune()
        granted = min(wanted, self.remaining(visitor))
        if granted < 1:
            raise QuotaExhausted(self.per_window, self.window_s, self.reset_in(visitor) or self.window_s)
        self._visitors.setdefault(visitor, _Visitor()).reserved += granted
        return Reservation(self, visitor, granted)

    def status(self, visitor: str) -> dict:
        """What the page shows: the quota, what is left now and when the next pass frees up."""
        if self.unlimited:
            return {"per_window": 0, "window_s": self.window_s, "remaining": None, "reset_s": 0}
        return {"per_window": self.per_window, "window_s": self.window_s,
                "remaining": self.remaining(visitor), "reset_s": math.ceil(self.reset_in(visitor))}

    def _settle(self, visitor: str, granted: int, used: int) -> None:
        if self.unlimited:
            return
        v = self._visitors[visitor]
        v.reserved -= granted
        if used:
            v.spent.append((self._clock(), used))
        if not v.spent and not v.reserved:
            del self._visitors[visitor]  # nothing to remember: the table holds active visitors only

    def _prune(self) -> None:
        now = self._clock()
        for name in [n for n, v in self._visitors.items()
                     if not v.reserved and not v.used(now, self.window_s)]:
            del self._visitors[name]

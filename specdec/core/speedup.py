"""Speed-up arithmetic for speculative decoding (Leviathan et al. 2023, section 3).

With per-token acceptance rate alpha (tokens accepted i.i.d.), k drafted
tokens per round, a draft step costing c target passes and a verification pass
costing v target passes (v ~ 1 when k+1 tokens cost about one token's forward):
  tokens per target pass  E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
  speed-up over target-only decoding   = E / (v + k c)
This is what adaptive draft length uses to pick k from observed acceptance.
"""
from __future__ import annotations

import math


def _check(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Expected tokens committed per round (= per target pass): (1 - alpha^(k+1)) / (1 - alpha)."""
    _check(alpha, k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Expected wall-clock speed-up over target-only decoding: E(alpha, k) / (v + k c)."""
    if c < 0 or v <= 0:
        raise ValueError(f"need c >= 0 and v > 0, got c={c}, v={v}")
    return expected_tokens_per_pass(alpha, k) / (v + k * c)


def best_k(alpha: float, c: float, v: float = 1.0, k_max: int = 16) -> int:
    """The k in 0..k_max with the highest speed-up (the smallest such k on ties)."""
    return max(range(k_max + 1), key=lambda k: (speedup(alpha, k, c, v), -k))


def break_even_alpha(k: int, c: float, v: float = 1.0) -> float | None:
    """The smallest alpha at which drafting k tokens pays off (speed-up >= 1).

    0.0 if it pays at any alpha; None if it never does (even alpha = 1 loses).
    Speed-up grows with alpha, so bisection finds the crossing.
    """
    if speedup(0.0, k, c, v) >= 1.0:
        return 0.0
    if speedup(1.0, k, c, v) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if speedup(mid, k, c, v) >= 1.0:
            hi = mid
        else:
            lo = mid
    return hi


class AcceptanceEstimator:
    """Online estimate of the acceptance rate alpha, overall and per draft position.

    A round with k drafted and m accepted tested min(k, m + 1) tokens: positions
    0..m-1 accepted, position m rejected (if m < k); later drafted tokens were
    never tested and say nothing. alpha = accepted tests / tests, as an
    exponential moving average (half-life in tests) so it follows drift, started
    from `prior` with the weight of `prior_weight` tests. Per-position rates are
    plain cumulative counts (for reports, as llama.cpp prints them).
    """

    def __init__(self, *, halflife: float = 64.0, prior: float = 0.5, prior_weight: float = 2.0) -> None:
        if halflife <= 0:
            raise ValueError(f"halflife must be > 0, got {halflife}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        self._decay = 0.5 ** (1.0 / halflife)
        self._acc = prior * prior_weight
        self._tests = prior_weight
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.tested_at: list[int] = []  # per position: how often it was tested
        self.accepted_at: list[int] = []  # per position: how often it was accepted

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"n_accepted must be in [0, n_drafted={n_drafted}], got {n_accepted}")
        tested = min(n_drafted, n_accepted + 1)
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        if tested == 0:
            return
        shrink = self._decay**tested
        self._acc = self._acc * shrink + n_accepted
        self._tests = self._tests * shrink + tested
        while len(self.tested_at) < tested:
            self.tested_at.append(0)
            self.accepted_at.append(0)
        for i in range(tested):
            self.tested_at[i] += 1
            self.accepted_at[i] += int(i < n_accepted)

    @property
    def alpha(self) -> float:
        return self._acc / self._tests

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate at draft position i given that position i was tested."""
        return [a / t if t else math.nan for a, t in zip(self.accepted_at, self.tested_at)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over all rounds (the headline "acceptance" number)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    def best_k(self, c: float, v: float = 1.0, k_max: int = 16) -> int:
        """The k that maximises expected speed-up at the current alpha."""
        return best_k(min(max(self.alpha, 0.0), 1.0), c, v, k_max)

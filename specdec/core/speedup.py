"""Speed-up arithmetic for speculative decoding (Leviathan et al. 2023, section 3).

With per-token acceptance rate alpha (tokens accepted i.i.d.), k drafted
tokens per round, a draft step costing c target passes and a verification pass
costing v target passes (v ~ 1 when k+1 tokens cost about one token's forward):
  tokens per target pass  E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
  speed-up over target-only decoding   = E / (v + k c)

Under load (one forward serving many sessions) the same question is asked of
goodput instead: `goodput` / `GoodputPolicy` below choose k per round from
acceptance by position, the draft's cost and the target's verify cost as a
function of the tokens in the forward; k = 0 wherever drafting does not pay.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from specdec.core.bounds import MAX_K


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


def best_k(alpha: float, c: float, v: float = 1.0, k_max: int = MAX_K) -> int:
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

    def best_k(self, c: float, v: float = 1.0, k_max: int = MAX_K) -> int:
        """The k that maximises expected speed-up at the current alpha."""
        return best_k(min(max(self.alpha, 0.0), 1.0), c, v, k_max)


# ---------------------------------------------------------------------------- goodput under load


def expected_committed(accept: Sequence[float], k: int) -> float:
    """Expected tokens a round drafting k commits: 1 + p_1 + p_1 p_2 + ... + p_1...p_k.

    `accept[i]` is the chance draft position i is accepted given the ones before
    it were; positions past the end of `accept` reuse its last value (1 token
    when it is empty: nothing is known to be accepted).
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    total, run = 1.0, 1.0
    for i in range(k):
        p = accept[min(i, len(accept) - 1)] if accept else 0.0
        run *= min(max(p, 0.0), 1.0)
        total += run
    return total


def interpolate_cost(points: Sequence[tuple[float, float]], tokens: float, flat_tokens: float = 8.0) -> float:
    """A forward's cost at `tokens` tokens from measured (tokens, ms) points.

    Piecewise linear between points (sorted by tokens; not forced monotone:
    on a CPU 2-3 rows can cost more than 5, another matmul kernel); past the
    last point, the last segment's slope, at least the prior's; before the first point or
    with a single point, the prior shape cost ~ (flat_tokens + T): a forward
    costs a fixed part worth `flat_tokens` tokens plus the same per token (on
    this kind of CPU one forward over 8-16 single-token rows costs 2-3x one
    row's). Raises ValueError with no points.
    """
    if not points:
        raise ValueError("no cost points")
    mono = sorted((max(float(t), 1e-9), float(ms)) for t, ms in points)
    t0, c0 = mono[0]
    if tokens <= t0 or len(mono) == 1:
        return c0 * (flat_tokens + tokens) / (flat_tokens + t0)
    for (ta, ca), (tb, cb) in zip(mono, mono[1:]):
        if tokens <= tb:
            return ca + (cb - ca) * (tokens - ta) / (tb - ta) if tb > ta else cb
    (ta, ca), (tb, cb) = mono[-2], mono[-1]
    slope = (cb - ca) / (tb - ta) if tb > ta else 0.0
    slope = max(slope, cb / (flat_tokens + tb))  # never flatter than the prior's per-token cost
    return cb + slope * (tokens - tb)


@dataclass(frozen=True)
class RoundCosts:
    """What one round costs in milliseconds, measured on the replicas a session uses.

    verify_ms(T): the target's forward over T tokens in all (its batch included).
    rows: sessions sharing a target forward now (>= 1; 1 = no batching or no load).
    draft_step_ms: one drafting step (a draft forward at the draft's current batch).
    draft_call_ms: a Propose call's cost beyond its steps (RPC, queueing); paid only when k > 0.
    round_ms: per round whatever k is (the Score call's RPC and queueing, the orchestrator).
    """

    verify_ms: Callable[[float], float]
    rows: float = 1.0
    draft_step_ms: float = 0.0
    draft_call_ms: float = 0.0
    round_ms: float = 0.0


def goodput(accept: Sequence[float], k: int, costs: RoundCosts) -> float:
    """Committed tokens per millisecond per session when every session in the forward drafts k.

    The forward's sessions are taken alike (SmartSpec's batch goodput): `rows`
    of them each send k + 1 tokens, so the target's forward has rows (k + 1)
    tokens and each session's round takes the draft's k steps plus that
    forward. The replica's goodput is rows times this, so the best k for one
    is the best for the replica. With one session (rows = 1) it is the classic
    speed-up E / (v + k c) in milliseconds. Under load the forward's cost grows
    with its tokens (compute-bound), and k (k + 1)-fold tokens cost more than
    the extra accepted ones earn: k = 0 wins.
    """
    rows = max(1.0, costs.rows)
    draft = costs.draft_call_ms + k * costs.draft_step_ms if k else 0.0
    ms = costs.round_ms + draft + costs.verify_ms(rows * (k + 1))
    return expected_committed(accept, k) / max(ms, 1e-9)


def best_goodput_k(accept: Sequence[float], costs: RoundCosts, k_max: int, margin: float = 0.05) -> int:
    """The k in 0..k_max with the highest goodput; k > 0 must beat k = 0 by `margin` (never a loss)."""
    g0 = goodput(accept, 0, costs)
    best, best_g = 0, g0 * (1.0 + margin)
    for k in range(1, k_max + 1):
        g = goodput(accept, k, costs)
        if g > best_g:
            best, best_g = k, g
    return best


# A token tree may cost this much more to verify than the chain of k it replaces: a tree of n
# tokens, k deep, measured 1.97 tokens per pass at n = 8 and 2.18 at n = 16 against a chain of
# k = 4's 1.69 on the embedded models (docs/benchmarks.md), a gain that pays for a dearer verify
# only up to about this much.
TREE_VERIFY_SLACK = 0.25


def tree_size(costs: RoundCosts | None, k: int, budget: int, slack: float = TREE_VERIFY_SLACK) -> int:
    """A token tree's size for a round that would draft a chain of k: the largest n <= budget whose
    verify over every row's n + 1 tokens costs at most (1 + slack) x the chain's over its k + 1.
    With nothing measured yet, the budget. 0 (a chain) when no tree larger than k fits: under load
    on a compute-bound target every extra token is paid for by every row."""
    if k <= 0 or budget <= k:
        return 0
    if costs is None:
        return budget
    rows = max(1.0, costs.rows)
    limit = (1.0 + slack) * costs.verify_ms(rows * (k + 1))
    fits = [n for n in range(k + 1, budget + 1) if costs.verify_ms(rows * (n + 1)) <= limit]
    return max(fits, default=0)


class PooledAcceptance:
    """Acceptance by position over many sessions (one draft replica), decaying so it follows drift.

    A new session's prior: before its own rounds say otherwise, it is
    expected to accept like the sessions before it.
    """

    def __init__(self, decay: float = 0.995) -> None:
        self.decay = decay
        self.tested: list[float] = []
        self.accepted: list[float] = []

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        tested = min(n_drafted, n_accepted + 1)
        if tested <= 0:
            return
        self.tested = [t * self.decay for t in self.tested]
        self.accepted = [a * self.decay for a in self.accepted]
        while len(self.tested) < tested:
            self.tested.append(0.0)
            self.accepted.append(0.0)
        for i in range(tested):
            self.tested[i] += 1
            self.accepted[i] += i < n_accepted

    def rate(self, i: int, weight: float = 1.0) -> float | None:
        """Position i's rate (positions past the data reuse the last); None with under `weight` tests."""
        if not self.tested:
            return None
        j = min(i, len(self.tested) - 1)
        return self.accepted[j] / self.tested[j] if self.tested[j] >= weight else None


class GoodputPolicy:
    """One session's k per round: best goodput at its acceptance by position; probing at k = 0.

    Acceptance by position: each position's accepted/tested counts, shrunk
    with the weight of `shrink` tests towards a prior: the same position's
    rate pooled over earlier sessions (`pooled`, when it has data), else the
    session's overall rate (an EWMA). A rarely tested position borrows it.
    The decision is taken afresh every round from the current costs, so a
    session returns to drafting as soon as the load falls. A session whose
    best k is 0 still drafts `probe_k` tokens after `probe_every` rounds at
    k = 0, so its acceptance stays measured (its text may have got easier);
    each probe after which k stays 0 doubles the wait, up to `probe_max`, so
    sustained load costs few probes. Without any cost measurement yet it
    drafts `start_k`.
    """

    def __init__(self, *, probe_every: int = 8, probe_max: int = 64, probe_k: int = 2, start_k: int = 2,
                 shrink: float = 4.0, margin: float = 0.05, halflife: float = 64.0) -> None:
        if probe_every < 1 or probe_k < 1 or probe_max < probe_every:
            raise ValueError("need probe_every >= 1, probe_k >= 1 and probe_max >= probe_every")
        self.estimator = AcceptanceEstimator(halflife=halflife)
        self.probe_every, self.probe_max, self.probe_k, self.start_k = probe_every, probe_max, probe_k, start_k
        self.shrink, self.margin = shrink, margin
        self.idle_rounds = 0  # rounds at k = 0 since the last draft
        self.wait = probe_every  # rounds at k = 0 before the next probe
        self.probes = 0
        self.pooled: PooledAcceptance | None = None  # set by the caller; observe() feeds it too

    def acceptance(self, k_max: int) -> list[float]:
        est = self.estimator
        alpha = min(max(est.alpha, 0.0), 1.0)
        out = []
        for i in range(k_max):
            tested = est.tested_at[i] if i < len(est.tested_at) else 0
            accepted = est.accepted_at[i] if i < len(est.accepted_at) else 0
            prior = self.pooled.rate(i) if self.pooled is not None else None
            out.append((accepted + self.shrink * (alpha if prior is None else prior)) / (tested + self.shrink))
        return out

    def choose(self, costs: RoundCosts | None, k_max: int) -> int:
        """This round's k (0..k_max)."""
        if k_max <= 0:
            return 0
        if costs is None:
            return min(self.start_k, k_max)
        k = best_goodput_k(self.acceptance(k_max), costs, k_max, self.margin)
        if k:
            self.idle_rounds, self.wait = 0, self.probe_every
            return k
        self.idle_rounds += 1
        if self.idle_rounds < self.wait:
            return 0
        self.probes += 1
        self.idle_rounds, self.wait = 0, min(2 * self.wait, self.probe_max)
        return min(self.probe_k, k_max)

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.estimator.observe(n_drafted, n_accepted)
        if self.pooled is not None:
            self.pooled.observe(n_drafted, n_accepted)


# ---------------------------------------------------------------------------- parallel speculation


def pre_draft_hit_rate(alpha: float, k: int, beta: float | None = None) -> float:
    """The share of rounds whose drafts were pre-drafted during the previous round's verify.

    A pre-draft is used when the previous round accepted all k drafts (alpha^k)
    and its bonus token was the draft's own guess (beta; by default alpha: under
    greedy the guess is right exactly when a (k+1)-th draft would have been
    accepted): h = alpha^k * beta.
    """
    _check(alpha, k)
    beta = alpha if beta is None else beta
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return alpha**k * beta if k else 0.0


def parallel_round_cost(alpha: float, k: int, c: float, v: float = 1.0, *, c0: float = 0.0,
                        beta: float | None = None) -> float:
    """Expected critical-path time of a round in parallel (post-verify) mode, in target passes.

        T_par = v + (1 - h) (c0 + k c) + h max(0, c0 + (k + 1) c - v)

    v: the verify pass over k + 1 tokens; c0 + k c: a Propose call drafting k
    (c0 its fixed part: RPC, queueing); h = pre_draft_hit_rate(alpha, k, beta).
    A hit round makes no draft call; it waits only for what of the pre-draft
    (k + 1 steps, started with the previous round's verify) outlasts that verify.
    A miss round drafts as in sequential mode. Sequential mode is h = 0:
    T_seq = v + c0 + k c.
    """
    if c < 0 or c0 < 0 or v <= 0:
        raise ValueError(f"need c >= 0, c0 >= 0 and v > 0, got c={c}, c0={c0}, v={v}")
    h = pre_draft_hit_rate(alpha, k, beta)
    draft = c0 + k * c if k else 0.0
    return v + (1.0 - h) * draft + h * max(0.0, c0 + (k + 1) * c - v)


def parallel_speedup(alpha: float, k: int, c: float, v: float = 1.0, *, c0: float = 0.0,
                     beta: float | None = None) -> float:
    """Expected speed-up of parallel mode over target-only decoding: E(alpha, k) / T_par.

    E = (1 - alpha^(k+1)) / (1 - alpha) tokens per round, as in sequential mode
    (the proposals are the same; only when they are made changes). With the
    draft off the critical path only on hits (h = alpha^(k+1) by default), the
    gain over sequential mode, E / T_par vs E / (v + c0 + k c), is largest at
    small k, where full acceptance is likeliest.
    """
    return expected_tokens_per_pass(alpha, k) / parallel_round_cost(alpha, k, c, v, c0=c0, beta=beta)


def best_parallel_k(alpha: float, c: float, v: Callable[[int], float] | float = 1.0, *, c0: float = 0.0,
                    beta: float | None = None, k_max: int = MAX_K) -> int:
    """The k in 0..k_max with the highest parallel-mode speed-up (smallest on ties).

    `v` may be a function of k (the verify pass's cost grows with its k + 1 tokens).
    """
    def vk(k: int) -> float:
        return v(k) if callable(v) else v

    return max(range(k_max + 1), key=lambda k: (parallel_speedup(alpha, k, c, vk(k), c0=c0, beta=beta), -k))

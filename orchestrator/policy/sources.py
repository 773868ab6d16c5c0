"""The combined proposer's choice each round: a free guess (prompt lookup's, suffix decoding's), or
the draft model at its k.

Lookup costs nothing to propose and is strong where the output copies its
context; the draft model costs a call and is the better guesser elsewhere; on a
compute-bound target neither may pay. Per round the goodput model
(specdec.core.speedup) compares, in committed tokens per millisecond:

    lookup, n tokens   E_L(n) / (round + v(rows (n + 1)))          no draft call
    draft, k tokens    E_D(k) / (round + call + k step + v(rows (k + 1)))
    nothing            1 / (round + v(rows))

with E(n) = 1 + p_1 + p_1 p_2 + ... from each option's own acceptance by
position (this session's, shrunk towards the orchestrator's pooled rates: the
draft replica's sessions for the draft, every combined session's lookup rounds
for lookup), and the costs measured on the session's replicas
(orchestrator.policy.costs). The draft's k, including k = 0 and its periodic
probes, is GoodputPolicy's choice; a free source wins when its best n beats it. Each free
source (lookup, suffix) has its own acceptance, pooled under its name; the best of them by
goodput is the one compared with the draft.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from orchestrator.common.kinds import DRAFT, LOOKUP
from orchestrator.policy.costs import CostBook
from specdec.core.speedup import GoodputPolicy, goodput

LOOKUP_POOL = LOOKUP  # CostBook.acceptance key of the lookup rounds' pooled acceptance (each free source's: its name)


class SourceChoice:
    """A free guess (of several sources) or the draft per round by goodput (see the module docstring)."""

    def __init__(self, book: CostBook, target: Callable[[], str], *, margin: float = 0.05,
                 free: tuple[str, ...] = (LOOKUP,)) -> None:
        self.book = book
        self.target = target  # the target replica's address now (a session may move)
        self.draft_policy = GoodputPolicy(margin=margin)
        self.free: dict[str, GoodputPolicy] = {}
        for name in free:
            policy = self.free[name] = GoodputPolicy(margin=margin)
            policy.pooled = book.acceptance(name)  # every session's rounds of this source, pooled

    @property
    def lookup_policy(self) -> GoodputPolicy:
        return self.free[LOOKUP]

    def choose(self, k_max: int, guesses: dict[str, list[int]] | list[int], draft: str | None) -> tuple[str, int]:
        """(source, tokens to propose): a free source with its guess's best prefix, else DRAFT with
        its k (k = 0 when there is no usable draft replica, `draft` None). `guesses`: each free
        source's guess by name (a list alone: prompt lookup's)."""
        if not isinstance(guesses, dict):
            guesses = {LOOKUP: guesses}
        costs = self.book.round_costs(self.target(), draft)
        if draft is None:
            k_draft = 0
        else:
            self.draft_policy.pooled = self.book.acceptance(draft)
            k_draft = self.draft_policy.choose(costs, k_max)
        guesses = {name: guess for name, guess in guesses.items() if guess}
        if not guesses:
            return DRAFT, k_draft
        if costs is None:  # nothing measured yet: the longest free guess first
            name = max(guesses, key=lambda source: len(guesses[source]))
            return name, len(guesses[name])
        free = replace(costs, draft_step_ms=0.0, draft_call_ms=0.0)
        best: tuple[float, str, int] | None = None
        for name, guess in guesses.items():
            policy = self.free[name]
            probes = policy.probes
            # The guess's best length against k = 0 (beating it by the margin); a source that has
            # not paid lately is still tried now and then, so one unlucky guess does not end it.
            n = policy.choose(free, len(guess))
            if not n:
                continue
            if policy.probes > probes:
                return name, n
            g = goodput(policy.acceptance(n), n, free)
            if best is None or g > best[0]:
                best = (g, name, n)
        if best is None:
            return DRAFT, k_draft
        g_draft = goodput(self.draft_policy.acceptance(max(k_draft, 1)), k_draft, costs)
        return (best[1], best[2]) if best[0] > g_draft else (DRAFT, k_draft)

    def observe(self, source: str, n_drafted: int, n_accepted: int) -> None:
        """The round's verdict teaches the option that proposed it."""
        if source in self.free:
            self.free[source].observe(n_drafted, n_accepted)
        elif source == DRAFT and n_drafted:
            self.draft_policy.observe(n_drafted, n_accepted)

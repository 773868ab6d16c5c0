"""The combined proposer's choice each round: prompt lookup's guess, or the draft model at its k.

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
probes, is GoodputPolicy's choice; lookup wins when its best n beats it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from orchestrator.kinds import DRAFT, LOOKUP
from orchestrator.policy.costs import CostBook
from specdec.core.speedup import GoodputPolicy, goodput

LOOKUP_POOL = "lookup"  # CostBook.acceptance key of the lookup rounds' pooled acceptance


class SourceChoice:
    """Lookup or draft per round by goodput (see the module docstring)."""

    def __init__(self, book: CostBook, target: Callable[[], str], *, margin: float = 0.05) -> None:
        self.book = book
        self.target = target  # the target replica's address now (a session may move)
        self.draft_policy = GoodputPolicy(margin=margin)
        self.lookup_policy = GoodputPolicy(margin=margin)
        self.lookup_policy.pooled = book.acceptance(LOOKUP_POOL)

    def choose(self, k_max: int, guess: list[int], draft: str | None) -> tuple[str, int]:
        """(source, tokens to propose): LOOKUP with the guess's best prefix, else DRAFT with its k
        (k = 0 when there is no usable draft replica, `draft` None)."""
        costs = self.book.round_costs(self.target(), draft)
        if draft is None:
            k_draft = 0
        else:
            self.draft_policy.pooled = self.book.acceptance(draft)
            k_draft = self.draft_policy.choose(costs, k_max)
        if not guess:
            return DRAFT, k_draft
        if costs is None:  # nothing measured yet: the free guess first
            return LOOKUP, len(guess)
        free = replace(costs, draft_step_ms=0.0, draft_call_ms=0.0)
        probes = self.lookup_policy.probes
        # The guess's best length against k = 0 (beating it by the margin); a lookup that has not
        # paid lately is still tried now and then, so one unlucky guess does not end it for good.
        n = self.lookup_policy.choose(free, len(guess))
        if not n:
            return DRAFT, k_draft
        if self.lookup_policy.probes > probes:
            return LOOKUP, n
        g_lookup = goodput(self.lookup_policy.acceptance(n), n, free)
        g_draft = goodput(self.draft_policy.acceptance(max(k_draft, 1)), k_draft, costs)
        return (LOOKUP, n) if g_lookup > g_draft else (DRAFT, k_draft)

    def observe(self, source: str, n_drafted: int, n_accepted: int) -> None:
        """The round's verdict teaches the option that proposed it."""
        if source == LOOKUP:
            self.lookup_policy.observe(n_drafted, n_accepted)
        elif source == DRAFT and n_drafted:
            self.draft_policy.observe(n_drafted, n_accepted)

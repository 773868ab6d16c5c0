"""The combined proposer: each round, prompt lookup or the draft service, whichever pays more.

Prompt lookup costs nothing to propose and is strong where the output copies
its context (rewriting, summarising, editing code); the draft model costs a
call and is the better guesser elsewhere; on a compute-bound target neither
may pay, and target-only is best. Per round this proposer takes the
lookup's candidate (free to compute) and asks the goodput model
(specdec.core.speedup) which option commits the most tokens per millisecond:

    lookup, n tokens   E_L(n) / (round + v(rows (n + 1)))          no draft call
    draft, k tokens    E_D(k) / (round + call + k step + v(rows (k + 1)))
    nothing            1 / (round + v(rows))

with E(n) = 1 + p_1 + p_1 p_2 + ... from each option's own acceptance by
position (this session's, shrunk towards the orchestrator's pooled rates:
the draft replica's sessions for the draft, every combined session's lookup
rounds for lookup), and the costs the orchestrator measured on the session's
replicas (orchestrator.policy.costs). The draft's k, including k = 0 and its
periodic probes, is GoodputPolicy's choice; lookup wins the round when its
best n beats that choice. A lookup round leaves the draft's cache as it was:
the next draft call sends the tokens it missed (its catch-up), as after any
round.

A draft that is ejected from routing (hung or far slower than its peers,
orchestrator.fleet.outliers) is left out of the choice for the round; one whose
call misses its deadline leaves the round to the lookup guess, if there is
one, else to the target alone.

Exactness does not depend on the choice: each round is verified against
what that round proposed (a lookup round with a one-hot q), so greedy output
is the target's and sampled output has its distribution. The choice uses
timings, so like `--default-k auto` a seeded sampled request may draw a
different (equally exact) text on another run.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from orchestrator.policy.costs import CostBook
from orchestrator.proposers.base import DraftContext, Proposal
from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.proposers.local import PromptLookupProposer
from orchestrator.fleet.remote import SessionReplica
from orchestrator.proposers.kinds import COMBINED, DRAFT, LOOKUP
from specdec.core.speedup import GoodputPolicy, RoundCosts, goodput

LOOKUP_POOL = "lookup"  # CostBook.acceptance key of the lookup rounds' pooled acceptance


class CombinedProposer:
    """Lookup or draft per round by goodput (see the module docstring)."""

    name = COMBINED
    adaptive = False  # it chooses its own k within the request's k
    proposes = True
    free_guesses = True  # a plain epoch of the speculation gate still takes a lookup guess that pays

    def __init__(self, draft: DraftServiceProposer, lookup: PromptLookupProposer, book: CostBook,
                 target: Callable[[], str], *, margin: float = 0.05) -> None:
        self.draft = draft
        self.lookup = lookup
        self.book = book
        self.target = target  # the target replica's address now (a session may move)
        self.margin = margin
        self.draft_policy = GoodputPolicy(margin=margin)
        self.lookup_policy = GoodputPolicy(margin=margin)
        self.lookup_policy.pooled = book.acceptance(LOOKUP_POOL)
        self._last = ""  # what proposed the last round: "lookup", "draft" or ""

    @property
    def replica(self) -> SessionReplica | None:
        return self.draft.replica

    @property
    def fallback_reason(self) -> str:
        return self.draft.fallback_reason

    @property
    def features(self):
        return self.draft.features

    async def propose(self, ctx: DraftContext) -> Proposal:
        guess = (await self.lookup.propose(ctx)).tokens if ctx.k else []
        draft_usable = bool(ctx.k) and not ctx.draft_off and await self.draft.usable()
        source, n = self.choose(ctx.k, guess, draft_usable=draft_usable)
        self._last = source
        if source == LOOKUP:
            return self._lookup_round(guess[:n])
        proposal = await self.draft.propose(replace(ctx, k=n))
        if proposal.deadline_misses and guess:  # the draft hung: the free guess takes the round
            self._last = LOOKUP
            return replace(self._lookup_round(guess), deadline_misses=proposal.deadline_misses)
        return replace(proposal, source=DRAFT if proposal.tokens else "")

    def _lookup_round(self, tokens: list[int]) -> Proposal:
        held = self.draft.replica.held if self.draft.replica is not None else 0
        return Proposal(tokens=tokens, cache_length=held, source=LOOKUP)

    def choose(self, k_max: int, guess: list[int], draft_usable: bool = True) -> tuple[str, int]:
        """(source, tokens to propose): LOOKUP with the guess's best prefix, else DRAFT with its k
        (k = 0 when the draft is not usable this round)."""
        replica = self.draft.replica if draft_usable else None
        draft_address = replica.address if replica is not None else None
        costs = self.book.round_costs(self.target(), draft_address)
        if draft_address is None:
            k_draft = 0
        else:
            self.draft_policy.pooled = self.book.acceptance(draft_address)
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

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        """The round's verdict teaches the option that proposed it."""
        if self._last == LOOKUP:
            self.lookup_policy.observe(n_drafted, n_accepted)
        elif self._last == DRAFT and n_drafted:
            self.draft_policy.observe(n_drafted, n_accepted)

    def lags(self, ctx: DraftContext) -> bool:
        return self.draft.lags(ctx)

    async def prefetch(self, ctx: DraftContext) -> int | None:
        return await self.draft.prefetch(ctx)

    def keep_feeding(self, feed: asyncio.Future) -> None:
        self.draft.keep_feeding(feed)

    def crop(self, length: int) -> None:
        self.draft.crop(length)

    def close(self) -> None:
        self.draft.close()

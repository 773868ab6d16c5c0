"""The combined proposer: each round, prompt lookup or the draft service, whichever pays more.

The choice is orchestrator.policy.sources'. A lookup round leaves the draft's
cache as it was: the next draft call sends the tokens it missed (its
catch-up), as after any round. A draft that is ejected from routing (hung or
far slower than its peers, orchestrator.fleet.outliers) is left out of the
choice for the round; one whose call misses its deadline leaves the round to
the lookup guess, if there is one, else to the target alone.

Exactness does not depend on the choice: each round is verified against what
that round proposed (a lookup round with a one-hot q), so greedy output is the
target's, sampled output has its distribution, and a seeded request (the
coupled sampler) commits target-only's tokens for its seed.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from orchestrator.policy.costs import CostBook
from orchestrator.policy.sources import LOOKUP_POOL, SourceChoice  # noqa: F401 - LOOKUP_POOL re-exported
from orchestrator.proposers.base import DraftContext, Proposal
from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.proposers.local import PromptLookupProposer
from orchestrator.fleet.remote import SessionReplica
from orchestrator.kinds import COMBINED, DRAFT, LOOKUP


class CombinedProposer:
    """Lookup or draft per round by goodput (see the module docstring)."""

    name = COMBINED
    adaptive = False  # it chooses its own k within the request's k
    proposes = True
    branches = True  # a draft round drafts a tree when asked; a lookup round is a chain
    free_guesses = True  # a plain epoch of the speculation gate still takes a lookup guess that pays

    def __init__(self, draft: DraftServiceProposer, lookup: PromptLookupProposer, book: CostBook,
                 target: Callable[[], str], *, margin: float = 0.05) -> None:
        self.draft = draft
        self.lookup = lookup
        self.sources = SourceChoice(book, target, margin=margin)
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
        guess = (await self.lookup.propose(replace(ctx, tree_nodes=0))).tokens if ctx.k else []  # a chain
        draft_usable = bool(ctx.k) and not ctx.draft_off and await self.draft.usable()
        source, n = self.choose(ctx.k, guess, draft_usable=draft_usable)
        self._last = source
        if source == LOOKUP:
            if ctx.tree_nodes:  # several occurrences' continuations, as a tree (when they branch)
                tree = await self.lookup.propose(replace(ctx, k=n))
                if tree.parents is not None:
                    return replace(self._lookup_round(tree.tokens), parents=tree.parents)
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
        """(source, tokens to propose) this round (orchestrator.policy.sources)."""
        replica = self.draft.replica if draft_usable else None
        return self.sources.choose(k_max, guess, replica.address if replica is not None else None)

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        self.sources.observe(self._last, n_drafted, n_accepted)

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

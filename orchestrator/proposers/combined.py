"""The combined proposer: each round, a free guess (prompt lookup, suffix decoding) or the draft
service, whichever pays more.

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
from collections.abc import Callable, Sequence
from dataclasses import replace

from orchestrator.policy.costs import CostBook
from orchestrator.policy.sources import LOOKUP_POOL, SourceChoice  # noqa: F401 - LOOKUP_POOL re-exported
from orchestrator.proposers.base import Committed, DraftContext, Proposal, Proposer
from orchestrator.fleet.remote import SessionReplica
from orchestrator.common.kinds import COMBINED, DRAFT, LOOKUP


class CombinedProposer(Proposer):
    """A free guess or the draft per round by goodput (see the module docstring)."""

    name = COMBINED
    adaptive = False  # it chooses its own k within the request's k
    proposes = True
    branches = True  # a draft round drafts a tree when asked; so does a free source that branches
    free_guesses = True  # a plain epoch of the speculation gate still takes a free guess that pays
    prefetches = True

    def __init__(self, draft: Proposer, free: Proposer | Sequence[Proposer], book: CostBook,
                 target: Callable[[], str], *, margin: float = 0.05) -> None:
        self.draft = draft
        self.free: dict[str, Proposer] = {p.name: p for p in ([free] if isinstance(free, Proposer) else free)}
        self.sources = SourceChoice(book, target, margin=margin, free=tuple(self.free))
        self._last = ""  # what proposed the last round: a free source's name, "draft" or ""

    @property
    def lookup(self) -> Proposer | None:
        return self.free.get(LOOKUP)

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
        if not ctx.k:  # a plain round (the gate's, or the end of the turn): no guess, no call, no choice
            self._last = ""
            return self._free_round("", [])
        chain = replace(ctx, tree_nodes=0)
        guesses = {name: (await source.propose(chain)).tokens if ctx.k else []
                   for name, source in self.free.items()}
        draft_usable = bool(ctx.k) and not ctx.draft_off and await self.draft.usable()
        source, n = self.choose(ctx.k, guesses, draft_usable=draft_usable)
        self._last = source
        if source in self.free:
            if ctx.tree_nodes and self.free[source].branches:  # several continuations, as a tree
                tree = await self.free[source].propose(replace(ctx, k=n))
                if tree.parents is not None:
                    return replace(self._free_round(source, tree.tokens), parents=tree.parents)
            return self._free_round(source, guesses[source][:n])
        proposal = await self.draft.propose(replace(ctx, k=n))
        best = max(guesses, key=lambda name: len(guesses[name]), default="")
        if proposal.deadline_misses and best and guesses[best]:  # the draft hung: a free guess takes it
            self._last = best
            return replace(self._free_round(best, guesses[best][: ctx.k]),
                           deadline_misses=proposal.deadline_misses)
        return replace(proposal, source=DRAFT if proposal.tokens else "")

    def _free_round(self, source: str, tokens: list[int]) -> Proposal:
        held = self.draft.replica.held if self.draft.replica is not None else 0
        return Proposal(tokens=tokens, cache_length=held, source=source)

    def choose(self, k_max: int, guesses: dict[str, list[int]] | list[int],
               draft_usable: bool = True) -> tuple[str, int]:
        """(source, tokens to propose) this round (orchestrator.policy.sources)."""
        replica = self.draft.replica if draft_usable else None
        return self.sources.choose(k_max, guesses, replica.address if replica is not None else None)

    def lags(self, ctx: DraftContext) -> bool:
        return self.draft.lags(ctx)

    async def prefetch(self, ctx: DraftContext) -> int | None:
        return await self.draft.prefetch(ctx)

    def keep_feeding(self, feed: asyncio.Future) -> None:
        self.draft.keep_feeding(feed)

    def commit(self, done: Committed) -> None:
        self.sources.observe(self._last, done.own, done.own_accepted)  # what the round's source got right
        self.draft.commit(done)
        for source in self.free.values():
            source.commit(done)

    def close(self) -> None:
        self.draft.close()
        for source in self.free.values():
            source.close()

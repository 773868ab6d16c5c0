"""Suffix decoding: continue the longest match in this tenant's earlier requests or the context.

The home (one per orchestrator process) keeps a `SuffixCache`
(specdec.core.suffix): each tenant's finished turns, prompt and output, at most
`LoopConfig.suffix_cache_tokens` tokens in all, the oldest evicted first. A
request's proposer matches the context's suffix against its tenant's earlier
turns and against the request's own tokens, and proposes the continuation of
whichever match is longer, as a chain or, when the round asks, a token tree.
Its length is its own (`own_length`): as long as the match, while the
continuation's estimated probability stays above `MIN_PROB`, at most the
round's k (max_k unless the request names k). When the turn ends its tokens (the last
`TURN_TOKENS`) join the cache, so the next request of the same tenant can match them. One tenant's
turns never propose to another.

The cache learns on the event loop a step at a time (`SuffixHome.remember`): one turn's tokens,
or a compaction after evictions, at most `specdec.core.suffix.CHUNK` tokens a step, one step per
turn of the loop, so no stream waits long for another's learning.

Deterministic, like every proposal without q: greedy output is the target's and
sampled output keeps its distribution (specdec.core.verify).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from orchestrator.config import LoopConfig
from orchestrator.common.kinds import SUFFIX
from orchestrator.proposers.base import Committed, DraftContext, Proposal, Proposer
from specdec.core.suffix import SuffixCache, SuffixIndex, propose_tree

log = logging.getLogger(__name__)

MIN_PROB = 0.1  # a continuation token's least estimated probability (its share of the occurrences)
# A turn's last tokens that join the cache: indexing costs a few microseconds a token (on the event
# loop, a step at a time), so a long conversation adds its recent part (the end of its prompt and
# the output).
TURN_TOKENS = 2048


class SuffixHome:
    """The cache shared by one orchestrator process's requests (per tenant)."""

    def __init__(self, config: LoopConfig) -> None:
        self.cache = SuffixCache(max_tokens=config.suffix_cache_tokens)
        self._learning: deque[Iterator[None]] = deque()  # turns to add, the first one under way
        self._stepping: asyncio.AbstractEventLoop | None = None  # the loop a next step is due on
        self.steps = 0  # steps taken, in all

    async def open(self, o) -> Proposer:
        return self.proposer(o.req.tenant)

    def proposer(self, tenant: str) -> SuffixProposer:
        """A request's proposer over this cache (the suffix kind's, or a combined proposer's source)."""
        return SuffixProposer(self.cache, tenant, remember=self.remember)

    def remember(self, tenant: str, tokens: Sequence[int]) -> None:
        """Add a finished turn to the cache, a step per turn of the event loop (at once where no
        loop runs)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.cache.add(tenant, tokens)
            return
        self._learning.append(self.cache.adding(tenant, tokens))
        if self._stepping is not loop:  # none due (or due on a loop that has ended: tests)
            self._stepping = loop
            loop.call_soon(self._step)

    def _step(self) -> None:
        self._stepping = None
        while self._learning:
            try:
                next(self._learning[0])
            except StopIteration:
                self._learning.popleft()
                continue
            except Exception:  # a defect: that turn is not learnt, the others still are
                log.exception("suffix cache: adding a turn failed")
                self._learning.popleft()
                continue
            self.steps += 1
            self._stepping = asyncio.get_running_loop()
            self._stepping.call_soon(self._step)
            return

    @property
    def learning(self) -> bool:
        """Turns are still being added."""
        return bool(self._learning)


class SuffixProposer(Proposer):
    """One request's suffix decoding (see the module docstring)."""

    name = SUFFIX
    branches = True
    own_length = True

    def __init__(self, cache: SuffixCache, tenant: str, *, min_prob: float = MIN_PROB,
                 remember: Callable[[str, Sequence[int]], None] | None = None) -> None:
        self.cache, self.tenant, self.min_prob = cache, tenant, min_prob
        self.remember = remember or cache.add  # how a finished turn joins the cache
        self.own = SuffixIndex()  # this request's tokens so far
        self.tokens: Sequence[int] = ()

    async def propose(self, ctx: DraftContext) -> Proposal:
        self._follow(ctx.tokens)
        if not ctx.k:
            return Proposal(tokens=[])
        nodes = ctx.tree_nodes or ctx.k
        width = max(1, ctx.tree_width) if ctx.tree_nodes else 1
        best: tuple[list[int], list[int], int] = ([], [], 0)
        for index in (self.cache.index(self.tenant), self.own):
            if index is None:
                continue
            found = propose_tree(index, ctx.tokens, ctx.k, nodes=nodes, width=width, min_prob=self.min_prob)
            if (found[2], len(found[0])) > (best[2], len(best[0])):
                best = found
        tokens, parents, _ = best
        if any(parent != i - 1 for i, parent in enumerate(parents)):  # it branches
            return Proposal(tokens=tokens, parents=parents)
        return Proposal(tokens=tokens)

    def commit(self, done: Committed) -> None:
        self.tokens = done.tokens

    def _follow(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        fed = len(self.own)
        if len(tokens) > fed:
            self.own.extend(tokens[fed:])

    def close(self) -> None:
        """The turn is over: its tokens join the tenant's cache (once)."""
        if self.tokens:
            self.remember(self.tenant, list(self.tokens[-TURN_TOKENS:]))
            self.tokens = ()

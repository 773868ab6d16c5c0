"""A draft with another tokenizer: its text, re-encoded in the target's vocabulary, is the proposal.

The draft model reads the committed text in its own vocabulary and drafts greedily; the
drafted text is re-encoded with the target's tokenizer and proposed as a deterministic
proposal, as prompt lookup's is. The target verifies it as a one-hot q (rejection sampling:
accept x with probability p(x), else draw from p without x), or against its own coupled draws
when seeded. Either is exact for any proposal that does not depend on the target's randomness
at the positions it proposes (sum over x of r(x) [1{y=x} p(x) + (1 - p(x)) p(y) 1{y!=x} / (1 - p(x))]
= p(y) for every proposal distribution r), so a poor translation costs acceptance, never the
output: greedy output stays the target's, token for token, and sampled output keeps the target's
distribution. This is the string-level exact-match family of speculative decoding across
vocabularies.

The draft's cache holds its own ids. Each round the committed target tokens are decoded and
re-encoded in the draft's vocabulary, and the draft keeps its cache up to the longest common
prefix with what it holds (a re-encoding may change the last tokens once more text follows);
the Propose's prefix fingerprint guards the rest, as for any draft.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

from orchestrator.proposers.base import Committed, DraftContext, Proposal, Proposer
from orchestrator.proposers.bridge import TextBridge
from orchestrator.proposers.draft import PREFETCH_MIN, DraftServiceProposer
from orchestrator.common.request import WireSampling
from specdec.core.fingerprint import EMPTY, extend
from specdec.core.kv import common_prefix
from specdec.core.sampling import SamplingParams

GREEDY = WireSampling.encode(SamplingParams())  # the draft drafts its most likely text


class TranslatedDraftProposer(Proposer):
    """The draft service's proposer for a draft with another tokenizer (see the module docstring).

    It wraps a DraftServiceProposer that works in the draft's ids: that one still owns the
    replica, its failover and fallback; this one keeps the draft-side ids and their
    fingerprints, and translates the drafts. No token trees, no feature drafts (a feature
    draft reads the target's features of the target's own tokens).
    """

    branches = False
    features = None
    prefetches = True

    def __init__(self, inner: DraftServiceProposer, bridge: TextBridge) -> None:
        self.inner, self.bridge = inner, bridge
        self._ids: list[int] = []  # the last round's committed text in draft ids
        self._fps: list[int] = [EMPTY]  # their prefix fingerprints
        self._held: list[int] | None = None  # the ids the draft replica holds, when known
        self._held_on = ""  # ... on this replica
        self._context = 0  # how many of them are committed text (the rest: the last drafts)

    replica = property(lambda self: self.inner.replica)
    fallback_reason = property(lambda self: self.inner.fallback_reason)
    proposes = property(lambda self: self.inner.proposes)
    adaptive = property(lambda self: self.inner.adaptive)
    name = property(lambda self: self.inner.name)

    async def usable(self) -> bool:
        return await self.inner.usable()

    async def learn_kind(self) -> None:
        await self.inner.learn_kind()

    def _draft_ctx(self, ctx: DraftContext) -> DraftContext:
        """The round's context in the draft's ids; the replica's held length cut to what it
        holds of them."""
        ids = self.bridge.draft_ids(ctx.tokens)
        keep = common_prefix(self._ids, ids)
        self._fps = self._fps[:keep + 1]
        for token in ids[keep:]:
            self._fps.append(extend(self._fps[-1], token))
        self._ids = ids
        replica = self.inner.replica
        if replica is not None:
            if self._held is not None and self._held_on == replica.address:
                replica.held = common_prefix(self._held, ids)
            replica.held = min(replica.held, len(ids))
        return replace(ctx, tokens=ids, prefix_fps=self._fps, prompt_len=min(ctx.prompt_len, len(ids)),
                       sampling=GREEDY, tree_nodes=0, tree_width=0)

    def _holds(self, ids: list[int], cache_length: int) -> None:
        replica = self.inner.replica
        self._held = ids[:cache_length] if replica is not None else None
        self._held_on = replica.address if replica is not None else ""

    def lags(self, ctx: DraftContext) -> bool:
        return self.inner.replica is not None and len(ctx.tokens) - self.inner.replica.held >= PREFETCH_MIN

    async def prefetch(self, ctx: DraftContext) -> int | None:
        dctx = self._draft_ctx(ctx)
        held = await self.inner.prefetch(dctx)
        if held is not None:
            self._context = min(held, len(dctx.tokens))
            self._holds(list(dctx.tokens), held)
        return held

    def keep_feeding(self, feed: asyncio.Future) -> None:
        self.inner.keep_feeding(feed)

    async def propose(self, ctx: DraftContext) -> Proposal:
        if self.inner.replica is None or ctx.k == 0 or ctx.draft_off:
            return Proposal(tokens=[], cache_length=len(ctx.tokens))
        dctx = self._draft_ctx(ctx)
        proposal = await self.inner.propose(dctx)
        self._context = len(dctx.tokens)
        self._holds([*dctx.tokens, *proposal.tokens], proposal.cache_length)
        text = self.bridge.drafted_text(dctx.tokens, proposal.tokens)
        tokens = self.bridge.to_target(ctx.tokens, text)[:ctx.k]
        # A one-hot proposal; the loop's crop of the draft is in target tokens, this one's is not.
        return replace(proposal, tokens=tokens, probs=None, parents=None, held=None,
                       cache_length=len(ctx.tokens))

    def commit(self, done: Committed) -> None:
        """The record's draft length: the committed text's ids it was sent (the drafts after them
        are kept only while the next round's text still starts with them)."""
        replica = self.inner.replica
        if replica is not None:
            replica.held = min(replica.held, self._context) if self._held is None else min(
                len(self._held), self._context)

    def close(self) -> None:
        self.inner.close()

"""The draft service's proposer: one Propose RPC per round, and everything about the draft replica.

It owns the replica's client, the length of the session's KV there, and what
to do when it dies (another live replica, else proposing nothing with a
`fallback_reason`, or UNAVAILABLE when the request is strict) or hangs (a call
past its learned deadline, or a replica ejected from routing with no other to
move to: that round proposes nothing and the next rounds use the draft again
once it is back). Parallel mode (orchestrator.proposers.parallel) also drafts
the next round while the target verifies this one.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from orchestrator.fleet.remote import DeadlineMissed, ModelClient, ServiceDown, SessionReplica, UpstreamError
from orchestrator.proposers.base import Committed, DraftContext, Proposal, Proposer
from orchestrator.proposers.features import FeatureRelay
from orchestrator.common.kinds import DRAFT, NONE
from specdec.runtime.errors import SpecdecError, Unavailable
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs, parse_feature_kind

log = logging.getLogger(__name__)
# A first round whose draft lacks at least this many committed tokens feeds it alongside the
# target's Score instead of drafting before it (DraftServiceProposer.prefetch).
PREFETCH_MIN = 16
STRICT_WAIT_S = 10.0  # how long a strict request waits on a late draft call before UNAVAILABLE


class DraftServiceProposer(Proposer):
    """One Propose RPC to the draft service per round.

    Sends only the committed tokens the draft does not hold yet (after a fully
    accepted round: the last drafted token and the bonus token — the draft's
    catch-up). A cache miss resends everything from position 0; a dead replica
    is replaced by another live one within the round, as is one that is
    draining or fails in any way that is not the request's own fault. With
    none left, any draft failure falls back to proposing nothing for the rest
    of the request (or raises UNAVAILABLE when `strict`); INVALID_ARGUMENT
    from the draft is our bug and is logged as an error. A hung draft costs
    rounds, not the request: a call past its deadline, or a replica ejected
    with no other usable, makes that round propose nothing. A `strict` request
    never goes on without its draft: a late call is waited on, up to
    STRICT_WAIT_S (a busy draft on a loaded machine can miss a learned
    deadline without being hung), and a draft that fails, or stays silent
    that long, fails the request with UNAVAILABLE.
    """

    branches = True  # Propose drafts a tree when asked (a feature head too, on its own outputs)
    prefetches = True

    def __init__(self, replica: SessionReplica | None, *, strict: bool = False, p_min: float = 0.0,
                 fallback_reason: str = "", relays: Callable[..., FeatureRelay] | None = None) -> None:
        self.replica = replica
        self._relays = relays or FeatureRelay  # (dim, layers) -> the request's relay (a kept one, multi-turn)
        self.strict = strict
        self.p_min = p_min
        self.fallback_reason = fallback_reason
        # A feature draft (the replica's GetInfo feature_dim > 0, learned at the first round):
        # the relay of target features, and the tokens the draft read with true features.
        self.features: FeatureRelay | None = None
        self._kind_known = False
        self._fed = 0
        self._feeding: asyncio.Future | None = None  # a first round's feed still running (keep_feeding)

    async def learn_kind(self) -> None:
        """Whether the replica is a feature draft (its GetInfo, asked once per client and cached)."""
        if self._kind_known or self.replica is None:
            return
        client = self.replica.client
        ask = getattr(client, "request_limit", None)  # (a test's in-process stand-in has no GetInfo)
        if ask is not None:
            try:
                await ask()
            except SpecdecError:
                return  # asked again next round; the call itself will fail over or fall back
        self._kind_known = True
        if getattr(client, "feature_dim", 0):
            self.features = self._relays(client.feature_dim, parse_feature_kind(getattr(client, "feature_kind", "")))

    @property
    def proposes(self) -> bool:
        return self.replica is not None

    @property
    def adaptive(self) -> bool:
        return self.replica is not None

    @property
    def name(self) -> str:
        return DRAFT if self.proposes else NONE

    async def usable(self) -> bool:
        """Whether this round may call the draft (moving the session off an ejected replica)."""
        return self.replica is not None and await self.replica.ready()

    def _request(self, ctx: DraftContext, position: int, k: int, features=None) -> model_pb2.ProposeRequest:
        """The Propose of the committed tokens from `position` on, drafting up to k."""
        return model_pb2.ProposeRequest(
            session_id=ctx.session_id, cache_position=position, prefix_hash=ctx.prefix_fps[position],
            tokens=ctx.tokens[position:], k=k, sampling=ctx.sampling.message,
            output_mode=ctx.sampling.output_mode, seed=ctx.seed, p_min=self.p_min, features=features,
            tenant=ctx.tenant, tree_nodes=ctx.tree_nodes if k else 0, tree_width=ctx.tree_width)

    def lags(self, ctx: DraftContext) -> bool:
        """Whether the draft lacks so much of the committed text (a new request's prompt) that
        feeding it alongside the target's Score (prefetch) beats drafting before it."""
        return self.replica is not None and len(ctx.tokens) - self.replica.held >= PREFETCH_MIN

    async def prefetch(self, ctx: DraftContext) -> int | None:
        """Feed the draft the committed tokens it lacks (a Propose with k = 0), meant to run while the
        target scores the same tokens: a first round then costs the target's prefill alone, not the
        draft's before it. The draft's held length afterwards, or None where nothing was fed (a
        feature draft, which reads the target's features of these tokens; no usable replica; any
        failure: the next Propose sends the tokens as its catch-up and handles the failure)."""
        if self.replica is None or not await self.replica.ready():
            return None
        await self.learn_kind()
        if self.features is not None:
            return None

        def send(client: ModelClient, position: int):
            return client.propose(self._request(ctx, position, 0))

        try:
            reply = await self.replica.call(send, len(ctx.tokens), wait_s=0.0)
        except SpecdecError as exc:
            log.info("session %s: feeding the draft its prompt failed (%s); its next Propose sends it",
                     ctx.session_id, exc)
            return None
        return int(reply.response.cache_length)

    def keep_feeding(self, feed: asyncio.Future) -> None:
        """A first round's feed (prefetch) that was still running when the target's Score came
        back: the round streams its chunk without waiting for it, and the next Propose waits for
        it first (so no token reaches the draft twice). At a load where drafting does not pay
        (the speculation gate then allows none) that Propose may never come; the feed's only cost
        is then the draft's own work, not the stream's time to its first token."""
        self._feeding = feed

    async def _fed_in_background(self) -> None:
        """The draft holds what a kept first-round feed gave it, once that feed is over."""
        feed, self._feeding = self._feeding, None
        if feed is None:
            return
        held = await feed  # prefetch answers None on any failure: the Propose then sends it all
        if held is not None and self.replica is not None:
            # The feed held the prompt, a prefix of the committed tokens; the rounds since then
            # cropped the bookkeeping to what was known before it ended.
            self.replica.held = max(self.replica.held, held)

    async def propose(self, ctx: DraftContext) -> Proposal:
        if self.replica is None or ctx.k == 0 or ctx.draft_off:  # nothing asked: the cache is untouched
            return Proposal(tokens=[], cache_length=self.replica.held if self.replica else 0)
        if self._feeding is not None:
            await self._fed_in_background()
        if not self.strict and not await self.replica.ready():
            return Proposal(tokens=[], cache_length=self.replica.held)  # ejected: sit this round out
        await self.learn_kind()
        relay = self.features
        if relay is not None and relay.known < len(ctx.tokens) - 1:
            # The features of the committed prefix come with this round's Score (a first round,
            # a new turn, a resume): nothing to draft from yet.
            return Proposal(tokens=[], cache_length=self.replica.held)

        def send(client: ModelClient, position: int):
            features = relay.rows_for(position, len(ctx.tokens) - position) if relay is not None else None
            return client.propose(self._request(ctx, position, ctx.k, features))

        if ctx.away is not None:
            ctx.away()
        try:
            reply = await self.replica.call(send, len(ctx.tokens), wait_s=0.0, extra=ctx.k,
                                            late_s=STRICT_WAIT_S if self.strict else 0.0)
        except SpecdecError as exc:  # any draft failure: the target alone can finish the request
            if isinstance(exc, DeadlineMissed) and not self.strict:
                log.info("session %s: %s (%s); this round goes on without the draft",
                         ctx.session_id, exc, exc.detail)
                return Proposal(tokens=[], cache_length=self.replica.held, deadline_misses=1)
            reason = "unavailable" if isinstance(exc, ServiceDown) else "failed"
            if self.strict:
                raise Unavailable(f"draft service {reason} and strict is set: {exc}") from None
            if isinstance(exc, UpstreamError) and exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                log.error("session %s: the draft service rejected our request (a bug here): %s; "
                          "falling back to target-only", ctx.session_id, exc)
            else:
                log.warning("session %s: %s; falling back to target-only", ctx.session_id, exc)
            self.replica, self.fallback_reason = None, f"draft service {reason}: {exc}"
            return Proposal(tokens=[])
        response = reply.response
        drafted = list(response.tokens)
        self._fed = len(ctx.tokens)  # read with the target's own features; the drafts with the head's
        tree = bool(response.parents)  # asked for a tree, and this replica drafts them
        probs = None  # a tree's nodes are candidates, verified as one-hot proposals (verify_tree_sampled)
        if ctx.sampling.output_mode == common_pb2.OUTPUT_MODE_PROBS and drafted and not tree:
            probs = decode_probs(response.probs)  # [n, vocab]
        return Proposal(drafted, probs, response.cache_length, reply.call, reply.cache_misses,
                        deadline_misses=reply.deadline_misses,
                        parents=list(response.parents) if tree else None,
                        held=list(response.held) if tree else None)

    def commit(self, done: Committed) -> None:
        # The acceptance is learnt by the loop's GoodputPolicy (adaptive k), not here.
        if self.replica is not None:
            length = done.draft_keeps()
            # A feature draft read its drafted tokens with its own predicted features: those
            # positions are fed again, with the target's, once committed.
            self.replica.held = min(length, self._fed) if self.features is not None else length

    def close(self) -> None:
        if self._feeding is not None and not self._feeding.done():
            self._feeding.cancel()  # the request is over: a feed nobody waits for stops
        self._feeding = None

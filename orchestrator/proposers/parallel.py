"""Parallel speculation: the draft drafts round n+1 while the target verifies round n.

Post-verify (PEARL's name for it). When round n's drafts d_1..d_m are handed
to the loop, a background task asks the draft service for the continuation
that assumes round n is fully accepted:

    Propose(cache_position = c + m - 1, tokens = [d_m], k = k + 1)

with c the tokens committed before round n. The draft holds c + m - 1 tokens
after its own Propose (every drafted token but the last), so this call feeds
d_m and drafts e_0 (its guess of the target's bonus token, at absolute
position c + m) and e_1..e_k (at c + m + 1 ...). It runs on the draft's device
while the target scores round n.

Round n+1 uses e_1..e_k at once, with no draft call on its critical path,
when round n committed exactly d_1..d_m and a bonus token equal to e_0: then
the committed prefix is the one e_1..e_k were drafted after, and the draft
service drew them with the same counter-based uniforms (seed, absolute
position, DRAFT) a sequential Propose would use, so they are the tokens (and
q) sequential mode would have proposed. Otherwise (a rejection, a different
bonus token, a stop, another replica, any error) the pre-draft is discarded
(cancelled if still running) and round n+1 proposes as in sequential mode;
the draft's cache is fixed by absolute length (cache_position and
prefix_hash) as always, so a discarded pre-draft never needs undoing.

The verifier is untouched: greedy output is the target's, and a seeded
sampled request gives the same text in both modes at the same k. (With a
feature draft, seeded sampled texts may differ between the modes, though both
follow the target's distribution: the pre-draft reads the head's own predicted
features, where a sequential Propose reads the target's.)

What it costs and earns: a hit needs full acceptance and a right bonus guess,
about alpha^(k+1) of rounds (specdec.core.speedup.parallel_speedup), so
parallel mode prefers a small k.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from orchestrator.proposers.base import DraftContext, PreDraft, Proposal

from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.fleet.remote import Call, DeadlineMissed, ModelClient, SessionReplica
from specdec.core.fingerprint import extend
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs
from specdec.core.bounds import MAX_K


@dataclass
class _Pending:
    """A pre-draft in flight for the round after the one that committed `base` + `drafted`."""

    task: asyncio.Task  # -> (ProposeResponse, Call)
    base: int  # tokens committed before the round that drafted `drafted`
    drafted: tuple[int, ...]
    client: ModelClient
    size: int  # tokens of work (fed + drafted), for its deadline


class ParallelDraftProposer(DraftServiceProposer):
    """The draft-service proposer with post-verify pre-drafting (see the module docstring)."""

    branches = False  # its pre-draft assumes a chain: the next round's drafts follow this one's

    def __init__(self, replica: SessionReplica | None, *, max_k: int = MAX_K, **kwargs) -> None:
        super().__init__(replica, **kwargs)
        self.max_k = max_k
        self._pending: _Pending | None = None
        self._missed = 0  # pre-drafts past their deadline, not yet in a round's Stats

    prefetches = False  # its pre-drafts already run beside the target's Score (and share the cache)

    async def propose(self, ctx: DraftContext) -> Proposal:
        pre, proposal = await self._take(ctx)
        if proposal is None:
            proposal = await super().propose(ctx)
            if pre is not None:
                proposal = replace(proposal, pre_draft=pre,
                                   deadline_misses=proposal.deadline_misses + self._missed)
                self._missed = 0
        self._launch(ctx, proposal)
        return proposal

    def close(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.task.done():
            pending.task.cancel()

    # ------------------------------------------------------------------ internals

    async def _take(self, ctx: DraftContext) -> tuple[PreDraft | None, Proposal | None]:
        """This round's pre-draft: (PreDraft, Proposal) on a hit, (PreDraft, None) on a miss,
        (None, None) when there was none."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None, None
        c, m = pending.base, len(pending.drafted)
        if (self.replica is not None and self.replica.client is pending.client and ctx.k > 0
                and len(ctx.tokens) == c + m + 1 and tuple(ctx.tokens[c : c + m]) == pending.drafted):
            started = time.perf_counter()
            try:
                response, call = await self._in_time(pending)
            except DeadlineMissed:  # counted in this round's Stats; its own Propose sits out
                self._missed += 1
                return PreDraft(hit=False), None
            except Exception:  # noqa: BLE001 - any failure: draft anew, which recovers or falls back
                return PreDraft(hit=False), None
            waited = (time.perf_counter() - started) * 1e3
            guessed = list(response.tokens)
            if len(guessed) > 1 and guessed[0] == ctx.tokens[-1]:
                return self._hit(ctx, response, call, waited)
        elif not pending.task.done():
            pending.task.cancel()
        await asyncio.gather(pending.task, return_exceptions=True)  # settled before the next call
        return PreDraft(hit=False), None

    async def _in_time(self, pending: _Pending) -> tuple[model_pb2.ProposeResponse, Call]:
        """The pre-draft's reply, or DeadlineMissed past its learned deadline (the replica is
        then ejected, and this round's own Propose sits out the round)."""
        health = self.replica.router.health
        limit = health.deadline_s("draft", pending.client.address, pending.size)
        done, _ = await asyncio.wait({pending.task}, timeout=limit)
        if not done:
            pending.task.cancel()
            health.missed("draft", pending.client.address, pending.size, limit)
            raise DeadlineMissed("the draft service missed its deadline (a pre-draft)")
        return pending.task.result()

    def _hit(self, ctx: DraftContext, response: model_pb2.ProposeResponse, call: Call,
             waited_ms: float) -> tuple[PreDraft, Proposal]:
        """e_1..e_k of a pre-draft whose e_0 was the bonus token: this round's proposal."""
        tokens = list(response.tokens)[1 : 1 + ctx.k]
        probs = None
        if ctx.sampling.output_mode == common_pb2.OUTPUT_MODE_PROBS:
            probs = decode_probs(response.probs)[1 : 1 + len(tokens)]
        pre = PreDraft(hit=True, call=call, waited_ms=waited_ms)
        # The draft holds what it fed: committed + e_1..e_{n-1} (n = all it drafted after e_0);
        # crop_lengths crops that to what this round accepts.
        return pre, Proposal(tokens, probs, response.cache_length, None, 0, pre)

    def _launch(self, ctx: DraftContext, proposal: Proposal) -> None:
        """Start drafting the next round on the assumption that this one is fully accepted."""
        drafted = list(proposal.tokens[: ctx.k])
        if self.replica is None or not drafted or ctx.k == 0:
            return
        c, m = len(ctx.tokens), len(drafted)
        position = c + m - 1  # the draft holds committed + every drafted token but the last
        if proposal.cache_length < position:
            return  # not the documented layout (cannot happen with a conforming service)
        prefix = ctx.prefix_fps[c]
        for token in drafted[:-1]:
            prefix = extend(prefix, token)
        request = model_pb2.ProposeRequest(
            session_id=ctx.session_id, cache_position=position, prefix_hash=prefix,
            tokens=drafted[-1:], k=min(ctx.k + 1, self.max_k), sampling=ctx.sampling.message,
            output_mode=ctx.sampling.output_mode, seed=ctx.seed, p_min=self.p_min, tenant=ctx.tenant,
        )
        client = self.replica.client
        self._pending = _Pending(asyncio.ensure_future(client.propose(request)), c, tuple(drafted), client,
                                 1 + request.k)

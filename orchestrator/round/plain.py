"""The Score of a plain round (nothing drafted, no hook adding to the request): sent lean.

A plain round is target-only decoding's every round, and every round of a session the drafting
policy holds at k = 0, so under load it is most rounds. Its Score is one batch item of the
replica's next ScoreBatch (orchestrator.fleet.batching), waited on directly under the replica's
learned deadline (the batcher's one watch timer) and learned from when it answers in time. It
skips SessionReplica.call's recovery loop, which every round paid for on its way to the same item.

Anything out of the ordinary gives the call back to the steps (orchestrator.round.steps.score ->
SessionReplica.call), which recover as they always have:

  * before sending: no batcher (a replica without batch calls), tracing on, a replica ejected
    from routing, a request over the replica's per-request limit or a limit not yet known;
  * after: an error of any kind (a cache miss is sent again from the held length, misses again
    and is resent from 0: one extra call, on a rare event), or no answer by the deadline: the miss
    is counted and learned (the replica is ejected) and the item abandoned; the steps then move
    the session where another replica is usable, else send again and wait up to the call's bound.

The response is the same message either way; what the steps make of it is theirs.
"""
from __future__ import annotations

import time

from orchestrator.fleet.remote import Reply
from orchestrator.proposers.base import DraftContext
from orchestrator.round.state import Turn
from specdec.runtime import tracing
from specdec.v1 import model_pb2

TARGET = "target"


async def score(turn: Turn, ctx: DraftContext) -> tuple[Reply | None, int]:
    """(the reply, 0), or (None, deadline misses) where the steps' call takes over."""
    target = turn.session.target
    client = target.client
    if getattr(client, "batcher", None) is None or tracing.ENABLED:  # (a stand-in client has none)
        return None, 0
    health, address = target.router.health, client.address
    if health.ejected(TARGET, address):
        return None, 0
    position = min(target.held, len(ctx.tokens) - 1)
    sampling = ctx.sampling
    pending = client.score_item(model_pb2.ScoreRequest(
        session_id=ctx.session_id, cache_position=position, prefix_hash=ctx.prefix_fps[position],
        tokens=ctx.tokens[position:], k=0, sampling=sampling.message, output_mode=sampling.output_mode,
        seed=ctx.seed, tenant=ctx.tenant))
    if pending is None:
        return None, 0
    own = len(ctx.tokens) - position
    size = health.latency.begin(TARGET, address, own)  # with this orchestrator's calls in flight there
    try:
        deadline_s = health.deadline_s(TARGET, address, size)
        started = time.monotonic()
        if not await pending.within(deadline_s):
            target.deadline_misses += 1
            health.missed(TARGET, address, size, deadline_s)
            pending.future.cancel()  # abandoned: the steps send the round again
            return None, 1
        try:
            response, call = pending.result()
        except Exception:  # noqa: BLE001 - a cache miss, a replica down, any status: the steps recover
            return None, 0
    finally:
        health.latency.end(TARGET, address, own)
    health.answered(TARGET, address, size, (time.monotonic() - started) * 1e3)
    return Reply(response, call), 0

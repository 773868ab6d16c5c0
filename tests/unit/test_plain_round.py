"""orchestrator.round.plain over a real ModelClient and CallBatcher: a plain round's Score is one
batch item at the held length, learned when it answers in time; a cache miss, an error, a missed
deadline or an ejected replica hands the call back to the steps (None), counting what it must.
The batch RPC is a function standing in for the replica (the wire and the steps' recovery are
tested end to end in tests/integration/test_gray.py and test_resilience.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from orchestrator.common.request import WireSampling
from orchestrator.fleet.deadlines import DeadlinePolicy
from orchestrator.fleet.outliers import ReplicaHealth
from orchestrator.fleet.remote import SessionReplica
from orchestrator.proposers.base import DraftContext
from orchestrator.round import plain
from specdec.core.fingerprint import prefix_fingerprints
from specdec.core.sampling import SamplingParams
from tests.unit.test_session_replica import Replica, Router, client_of

TOKENS = [5, 6, 7, 8]


def turn_on(client, health: ReplicaHealth, held: int) -> tuple[SimpleNamespace, DraftContext, SessionReplica]:
    target = SessionReplica(Router(health, {}), "target", "s", client, held=held)
    ctx = DraftContext("s", TOKENS, prefix_fingerprints(TOKENS), 2, 0, WireSampling.encode(SamplingParams()), 0)
    return SimpleNamespace(session=SimpleNamespace(target=target)), ctx, target


def test_a_plain_round_is_one_batch_item_at_the_held_length_and_learned() -> None:
    async def body():
        replica = Replica("a:1", holds=4)
        client = client_of(replica)
        health = ReplicaHealth()
        turn, ctx, _ = turn_on(client, health, held=3)
        reply, missed = await plain.score(turn, ctx)
        assert missed == 0 and list(reply.response.argmax_ids) == [7]
        assert [(r.cache_position, list(r.tokens), r.k) for r in replica.seen] == [(3, [8], 0)]
        assert replica.seen[0].prefix_hash == ctx.prefix_fps[3]
        assert health.latency.usual_ms("target", "a:1", 1) is not None  # answered in time: learned
        assert health.latency.in_flight == {}  # its tokens no longer count as in flight
        await client.close()

    asyncio.run(body())


def test_a_cache_miss_goes_back_to_the_steps_and_teaches_nothing() -> None:
    async def body():
        replica = Replica("a:1", holds=0)  # restarted: holds nothing
        client = client_of(replica)
        health = ReplicaHealth()
        turn, ctx, _ = turn_on(client, health, held=3)
        assert await plain.score(turn, ctx) == (None, 0)
        assert len(replica.seen) == 1 and health.latency.usual_ms("target", "a:1", 1) is None
        await client.close()

    asyncio.run(body())


def test_a_missed_deadline_is_counted_ejects_the_replica_and_goes_back_to_the_steps() -> None:
    async def body():
        client = client_of(Replica("a:1", holds=4, hang=True))
        health = ReplicaHealth(DeadlinePolicy(cold_s=0.05, floor_ms=50.0))
        turn, ctx, target = turn_on(client, health, held=3)
        assert await plain.score(turn, ctx) == (None, 1)
        assert target.deadline_misses == 1 and health.ejected("target", "a:1")
        # Ejected: the next plain round sends nothing; the steps move the session or call anyway.
        assert await plain.score(turn, ctx) == (None, 0)
        await client.close()

    asyncio.run(body())


def test_a_request_over_the_replica_s_limit_is_left_to_the_steps_unsent() -> None:
    async def body():
        replica = Replica("a:1", holds=4)
        client = client_of(replica)
        client._request_limit = 2  # a chunked prefill: the steps' call splits it
        turn, ctx, _ = turn_on(client, ReplicaHealth(), held=0)
        assert await plain.score(turn, ctx) == (None, 0)
        assert replica.seen == []
        await client.close()

    asyncio.run(body())

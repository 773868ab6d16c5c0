"""SessionReplica.call over a real CallBatcher: a round's Score goes as a batch item whose future is
waited on directly (no task per call), and keeps every recovery of the call: the cache-miss resend
from 0, the learned deadline (and the move it triggers), a late answer waited on where no other
replica is usable. The batch RPC is a function standing in for the replica (the wire is tested in
tests/integration)."""
from __future__ import annotations

import asyncio

import pytest

from orchestrator.fleet.batching import CallBatcher
from orchestrator.fleet.deadlines import DeadlinePolicy
from orchestrator.fleet.outliers import ReplicaHealth
from orchestrator.fleet.remote import DeadlineMissed, ModelClient, Pending, SessionReplica
from specdec.runtime.errors import CacheMiss
from specdec.v1 import model_pb2

HANG = object()  # a replica that never answers this item


class Replica:
    """A target replica's batch RPC: answers each item, raises a cache miss, or hangs."""

    def __init__(self, address: str, *, holds: int = 0, hang: bool = False, delay_s: float = 0.0) -> None:
        self.address, self.holds, self.hang, self.delay_s = address, holds, hang, delay_s
        self.seen: list[model_pb2.ScoreRequest] = []

    async def send(self, items) -> list:
        out = []
        for item in items:
            request = model_pb2.ScoreRequest.FromString(item.payload)
            self.seen.append(request)
            if request.cache_position > self.holds:
                out.append(CacheMiss(f"target {self.address}: prefix mismatch at {request.cache_position}"))
            else:
                out.append((model_pb2.ScoreResponse(argmax_ids=[7], cache_length=len(request.tokens)), 0.0, 0.0))
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        return out


class Router:
    def __init__(self, health: ReplicaHealth, others: dict[str, ModelClient]) -> None:
        self.health, self.others = health, others

    async def pick(self, role, preferred="", exclude=(), *, healthy=False, room=None):
        return next((c for a, c in self.others.items() if a not in exclude), None)


def client_of(replica: Replica) -> ModelClient:
    client = ModelClient(replica.address, "target")  # its channel never connects: the batcher's RPC is replaced
    client._batcher = CallBatcher(replica.send)
    client._request_limit = 0  # known: no limit
    return client


def send(client: ModelClient, position: int) -> Pending:
    return client.score(model_pb2.ScoreRequest(session_id="s", cache_position=position, tokens=[1, 2, 3][position:]))


def test_a_round_s_score_is_a_batch_item_not_a_task() -> None:
    async def body():
        client = client_of(Replica("a:1", holds=3))
        pending = send(client, 2)
        assert isinstance(pending.future, asyncio.Future) and not isinstance(pending.future, asyncio.Task)
        response, call = await pending
        assert list(response.argmax_ids) == [7] and call.tokens == 1
        await client.close()

    asyncio.run(body())


def test_a_cache_miss_resends_from_zero_and_counts_once() -> None:
    async def body():
        replica = Replica("a:1", holds=0)  # restarted: holds nothing
        client = client_of(replica)
        health = ReplicaHealth()
        session = SessionReplica(Router(health, {}), "target", "s", client, held=2)
        reply = await session.call(send, 3, wait_s=1.0)
        assert reply.cache_misses == 1
        assert [r.cache_position for r in replica.seen] == [2, 0]
        assert list(replica.seen[-1].tokens) == [1, 2, 3]
        assert health.latency.usual_ms("target", "a:1", 3) is None  # a miss's time is not learned
        await client.close()

    asyncio.run(body())


def test_a_clean_answer_is_learned_as_the_replica_s_pace() -> None:
    async def body():
        client = client_of(Replica("a:1", holds=3))
        health = ReplicaHealth()
        session = SessionReplica(Router(health, {}), "target", "s", client, held=2)
        reply = await session.call(send, 3, wait_s=1.0)
        assert reply.cache_misses == 0 and reply.deadline_misses == 0
        assert health.latency.usual_ms("target", "a:1", 3) is not None
        await client.close()

    asyncio.run(body())


@pytest.mark.parametrize("other", [True, False])
def test_a_hung_replica_misses_its_deadline_and_the_session_moves_or_waits(other: bool) -> None:
    async def body():
        hung, good = Replica("a:1", holds=3, hang=True), Replica("b:2", holds=3)
        a, b = client_of(hung), client_of(good)
        health = ReplicaHealth(DeadlinePolicy(cold_s=0.05, floor_ms=50.0))
        session = SessionReplica(Router(health, {"b:2": b} if other else {}), "target", "s", a, held=2)
        if other:
            reply = await session.call(send, 3, wait_s=5.0)
            assert session.address == "b:2" and reply.deadline_misses == 1
            assert [r.cache_position for r in good.seen] == [0]  # the new replica holds nothing: from 0
        else:
            with pytest.raises(Exception) as caught:  # waited on up to wait_s, then given up
                await session.call(send, 3, wait_s=0.3)
            assert not isinstance(caught.value, DeadlineMissed) and "did not answer in time" in str(caught.value)
            assert session.deadline_misses == 1
        for c in (a, b):
            await c.close()

    asyncio.run(body())


def test_a_late_answer_with_no_other_replica_is_waited_on_and_used() -> None:
    """The batcher's watch tells the call it is late; the answer that comes after is the reply."""
    async def body():
        slow = Replica("a:1", holds=3, delay_s=0.3)
        client = client_of(slow)
        health = ReplicaHealth(DeadlinePolicy(cold_s=0.05, floor_ms=50.0))
        session = SessionReplica(Router(health, {}), "target", "s", client, held=2)
        reply = await session.call(send, 3, wait_s=5.0)
        assert list(reply.response.argmax_ids) == [7] and reply.deadline_misses == 1
        assert len(slow.seen) == 1  # waited on, not resent
        assert health.latency.usual_ms("target", "a:1", 3) is None  # a late answer is not learned
        await client.close()

    asyncio.run(body())

"""orchestrator.fleet.streams: batches over one stream, against a real gRPC server in this process.

The server here answers ScoreStream the way a model service's does (each batch
on its own, answered when done, with its batch_id), but on a plan the test
sets: out of order, never, or by breaking the stream.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.fleet.batching import frame
from orchestrator.fleet.streams import BatchStream, NoStream, StreamFailed, batch_id_field
from orchestrator.fleet.remote import ModelClient
from specdec.v1 import common_pb2, model_pb2
from tests.ports import free_port

PATH = "/specdec.v1.TargetService/ScoreStream"


def batch_bytes(*session_ids: str) -> bytes:
    return b"".join(frame(model_pb2.ScoreRequest(session_id=s).SerializeToString()) for s in session_ids)


def test_the_batch_id_field_is_what_protobuf_writes() -> None:
    for batch_id in (1, 127, 128, 300, 2 ** 40):
        ours = batch_bytes("a", "b") + batch_id_field(batch_id)
        assert ours == model_pb2.ScoreBatchRequest(
            items=[model_pb2.ScoreRequest(session_id="a"), model_pb2.ScoreRequest(session_id="b")],
            batch_id=batch_id).SerializeToString()


class Plan:
    """How the test server answers: each batch after `delay_s[first item]` (default 0); a batch whose
    first session is "never" is not answered; one whose first session is "break" aborts the stream."""

    def __init__(self, delay_s: dict[str, float] | None = None) -> None:
        self.delay_s = delay_s or {}
        self.streams = 0


async def serve(plan: Plan, *, with_stream: bool = True) -> tuple[grpc.aio.Server, str]:
    async def score_stream(requests, context):
        plan.streams += 1
        out: asyncio.Queue = asyncio.Queue()

        async def one(batch):
            first = batch.items[0].session_id
            if first == "never":
                return
            if first in ("break", "crash"):
                out.put_nowait(first)
                return
            await asyncio.sleep(plan.delay_s.get(first, 0.0))
            reply = model_pb2.ScoreBatchResponse(batch_id=batch.batch_id)
            for item in batch.items:
                reply.items.add(cache_length=len(item.session_id))
                reply.status.add(code=0)
            out.put_nowait(reply)

        async def read():
            async for batch in requests:
                asyncio.get_running_loop().create_task(one(batch))

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                reply = await out.get()
                if reply == "break":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "draining: going away")
                if reply == "crash":  # what a stream cut under a stopping replica can end with
                    await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
                yield reply
        finally:
            reader.cancel()

    async def score_batch(batch, context):
        reply = model_pb2.ScoreBatchResponse()
        for item in batch.items:
            reply.items.add(cache_length=len(item.session_id))
            reply.status.add(code=0)
        return reply

    handlers = {
        "ScoreBatch": grpc.unary_unary_rpc_method_handler(
            score_batch, request_deserializer=model_pb2.ScoreBatchRequest.FromString,
            response_serializer=model_pb2.ScoreBatchResponse.SerializeToString),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            lambda request, context: common_pb2.ModelInfo(role="target"),
            request_deserializer=common_pb2.GetInfoRequest.FromString,
            response_serializer=common_pb2.ModelInfo.SerializeToString),
    }
    if with_stream:
        handlers["ScoreStream"] = grpc.stream_stream_rpc_method_handler(
            score_stream, request_deserializer=model_pb2.ScoreBatchRequest.FromString,
            response_serializer=model_pb2.ScoreBatchResponse.SerializeToString)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specdec.v1.TargetService", handlers),))
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _with_stream(plan: Plan, body, *, timeout_s: float = 10.0, with_stream: bool = True):
    server, address = await serve(plan, with_stream=with_stream)
    channel = grpc.aio.insecure_channel(address)
    opener = channel.stream_stream(PATH)
    stream = BatchStream(lambda: opener(), model_pb2.ScoreBatchResponse.FromString, name="test", timeout_s=timeout_s)
    try:
        return await body(stream)
    finally:
        stream.close()
        await channel.close()
        await server.stop(None)


def test_batches_answered_out_of_order_reach_their_own_callers_over_one_stream() -> None:
    plan = Plan({"slow": 0.3})

    async def body(stream: BatchStream):
        slow = asyncio.ensure_future(stream.send(batch_bytes("slow", "x")))
        await asyncio.sleep(0.05)
        fast = await stream.send(batch_bytes("fast", "yy", "zzz"))
        assert not slow.done()  # the later batch came back first
        slow_reply, _ = await slow
        return slow_reply, fast[0]

    slow, fast = asyncio.run(_with_stream(plan, body))
    assert [i.cache_length for i in slow.items] == [4, 1]
    assert [i.cache_length for i in fast.items] == [4, 2, 3]
    assert plan.streams == 1


def test_a_broken_stream_fails_every_waiting_batch_with_its_status_and_the_next_batch_reopens() -> None:
    plan = Plan()

    async def body(stream: BatchStream):
        waiting = asyncio.ensure_future(stream.send(batch_bytes("never")))
        await asyncio.sleep(0.05)
        with pytest.raises(StreamFailed) as broke:
            await stream.send(batch_bytes("break"))
        with pytest.raises(StreamFailed) as also:
            await waiting
        again, _ = await stream.send(batch_bytes("abc"))
        return broke.value, also.value, again, stream.opened

    broke, also, again, opened = asyncio.run(_with_stream(plan, body))
    assert broke.code == grpc.StatusCode.UNAVAILABLE and broke.details.startswith("draining:")
    assert also.code == grpc.StatusCode.UNAVAILABLE
    assert [i.cache_length for i in again.items] == [3]
    assert opened == 2 and plan.streams == 2


def test_a_stream_that_breaks_in_transit_means_the_replica_is_gone() -> None:
    async def body(stream: BatchStream):
        with pytest.raises(StreamFailed) as broke:
            await stream.send(batch_bytes("crash"))
        return broke.value

    broke = asyncio.run(_with_stream(Plan(), body))
    assert broke.code == grpc.StatusCode.UNAVAILABLE and "INTERNAL: Internal error from Core" in broke.details


def test_an_unanswered_batch_times_out_and_the_stream_is_not_trusted_again() -> None:
    plan = Plan()

    async def body(stream: BatchStream):
        with pytest.raises(StreamFailed) as late:
            await stream.send(batch_bytes("never"))
        reply, _ = await stream.send(batch_bytes("ok"))
        return late.value, reply, stream.opened

    late, reply, opened = asyncio.run(_with_stream(plan, body, timeout_s=0.3))
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert [i.cache_length for i in reply.items] == [2] and opened == 2


def test_a_replica_without_the_stream_says_so() -> None:
    async def body(stream: BatchStream):
        with pytest.raises(NoStream):
            await stream.send(batch_bytes("a"))

    asyncio.run(_with_stream(Plan(), body, with_stream=False))


def test_a_client_goes_back_to_batch_calls_where_a_replica_has_no_stream() -> None:
    async def main(with_stream: bool):
        plan = Plan()
        server, address = await serve(plan, with_stream=with_stream)
        client = ModelClient(address, "target")
        try:
            replies = [await client.score(model_pb2.ScoreRequest(session_id=s)) for s in ("a", "bb")]
            return [r.cache_length for r, _ in replies], plan.streams, client._stream is not None
        finally:
            await client.close()
            await server.stop(None)

    assert asyncio.run(main(True)) == ([1, 2], 1, True)  # both calls over the one stream
    assert asyncio.run(main(False)) == ([1, 2], 0, False)  # ScoreBatch calls, the stream given up

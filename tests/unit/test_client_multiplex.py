"""client.multiplex against small in-process gRPC servers that speak the Orchestrator contract:
an older server without GenerateMany, a stream that breaks mid-generation, a timeout, a cancel.

The servers here are protocol fixtures (what an old or dying orchestrator sends on the wire); the
client under test is the real AsyncClient over real gRPC channels.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from client import AsyncClient
from specdec.v1 import orchestrator_pb2 as pb

SERVICE = "specdec.v1.Orchestrator"


def _chunk(start: int, *ids: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(text="".join(f"<{i}>" for i in ids), token_ids=list(ids),
                                              start_index=start, session_id="s1"))


def _stats(n: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(stats=pb.Stats(new_tokens=n, prompt_tokens=3))


class Orchestrator:
    """Generate answers tokens 10, 11, 12, ... after what the request delivered; GenerateMany (when
    `many`) runs the same per generation, and with `break_after` aborts the stream UNAVAILABLE
    once that many chunks went out; `slow` waits between chunks."""

    def __init__(self, *, many: bool, break_after: int = 0, slow: float = 0.0) -> None:
        self.many, self.break_after, self.slow = many, break_after, slow
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[int] = []
        self.readers: list[asyncio.Task] = []
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def _responses(self, request: pb.GenerateRequest):
        self.requests.append(request)
        have = len(request.delivered[0].token_ids) if request.delivered else 0
        for i in range(have, request.max_new_tokens):
            if self.slow:
                await asyncio.sleep(self.slow)
            yield _chunk(3 + i, 10 + i)
        yield _stats(request.max_new_tokens)

    async def generate(self, request, context):
        async for response in self._responses(request):
            yield response

    async def generate_many(self, requests, context):
        starts: asyncio.Queue = asyncio.Queue()

        async def read():  # cancels are seen while a generation runs, as a real server sees them
            try:
                async for message in requests:
                    if message.cancel:
                        self.cancelled.append(message.id)
                    else:
                        starts.put_nowait(message)
            except Exception:  # noqa: BLE001 - the stream was aborted under it
                pass
            starts.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        self.readers.append(reader)
        sent = 0
        while (message := await starts.get()) is not None:
            async for response in self._responses(message.request):
                if message.id in self.cancelled:
                    break
                yield pb.GenerateManyResponse(events=[pb.TaggedResponse(id=message.id, response=response)])
                sent += 1
                if self.break_after and sent >= self.break_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            else:
                yield pb.GenerateManyResponse(events=[pb.TaggedResponse(id=message.id, end=True)])
        await reader

    async def start(self) -> Orchestrator:
        handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
            self.generate, request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=pb.GenerateResponse.SerializeToString)}
        if self.many:
            handlers["GenerateMany"] = grpc.stream_stream_rpc_method_handler(
                self.generate_many, request_deserializer=pb.GenerateManyRequest.FromString,
                response_serializer=pb.GenerateManyResponse.SerializeToString)
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self.server.stop(0)
        await asyncio.gather(*self.readers, return_exceptions=True)


async def _until(done, timeout_s: float = 10.0) -> None:
    """Wait for `done()` (a busy machine may take a while to deliver a message)."""
    for _ in range(int(timeout_s / 0.02)):
        if done():
            return
        await asyncio.sleep(0.02)


def test_an_older_server_without_generate_many_gets_generate_calls():
    async def run():
        old = await Orchestrator(many=False).start()
        try:
            async with AsyncClient(old.address, multiplex=True, timeout=10) as client:
                first = await client.complete("p", max_new_tokens=3)
                second = await client.complete("p", max_new_tokens=2)
                return first, second, list(client._muxes.values())[0]
        finally:
            await old.stop()

    first, second, mux = asyncio.run(run())
    assert list(first.token_ids) == [10, 11, 12] and list(second.token_ids) == [10, 11]
    assert mux._plain  # UNIMPLEMENTED once, plain Generate from then on


def test_a_broken_stream_resumes_each_generation_on_the_next_address_from_what_it_received():
    async def run():
        dying = await Orchestrator(many=True, break_after=2).start()
        other = await Orchestrator(many=True).start()
        try:
            async with AsyncClient([dying.address, other.address], multiplex=True, timeout=10) as client:
                done = await client.complete("p", max_new_tokens=5)
                return done, other.requests
        finally:
            await dying.stop()
            await other.stop()

    done, resumed = asyncio.run(run())
    assert list(done.token_ids) == [10, 11, 12, 13, 14]  # no gap, no duplicate
    assert len(resumed) == 1 and resumed[0].session_id == "s1" and resumed[0].resume_from == 5
    assert list(resumed[0].delivered[0].token_ids) == [10, 11]


def test_a_generation_past_its_timeout_is_cancelled_on_the_server_and_raises_deadline_exceeded():
    async def run():
        slow = await Orchestrator(many=True, slow=0.2).start()
        try:
            async with AsyncClient(slow.address, multiplex=True, timeout=0.5, retries=0) as client:
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await client.complete("p", max_new_tokens=50)
                await _until(lambda: slow.cancelled)  # the cancel reaches the server
                return late.value, slow.cancelled
        finally:
            await slow.stop()

    error, cancelled = asyncio.run(run())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled == [1]


def test_a_cancelled_stream_tells_the_server_and_the_stream_then_closes():
    async def run():
        slow = await Orchestrator(many=True, slow=0.05).start()
        try:
            async with AsyncClient(slow.address, multiplex=True, timeout=10) as client:
                stream = client.generate("p", max_new_tokens=50)
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as stopped:
                    async for chunk in stream:
                        got.append(chunk)
                        if len(got) == 2:
                            stream.cancel()
                mux = list(client._muxes.values())[0]
                await _until(lambda: slow.cancelled and mux._open is None)
                return stopped.value, slow.cancelled, mux
        finally:
            await slow.stop()

    error, cancelled, mux = asyncio.run(run())
    assert error.code() == grpc.StatusCode.CANCELLED
    assert cancelled == [1]
    assert mux.idle and mux._open is None  # nothing live: the stream was half-closed

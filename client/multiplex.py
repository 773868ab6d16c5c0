"""Many generations over one GenerateMany stream (asyncio), each shaped like a Generate call.

`Multiplexed(channel).generate(request, timeout=...)` returns a `MuxCall`: iterate it for the
generation's GenerateResponses as from `stub.Generate(request)`; it raises a `grpc.aio.AioRpcError`
with the generation's status when the generation fails, and `cancel()` stops it. Every call made
on one `Multiplexed` shares one stream, opened with the first and again after a break, so the
orchestrator sends the chunks of all of them that commit together as one message
(orchestrator.api.multiplex).

A break of the stream fails every generation on it with the stream's status (UNAVAILABLE when the
orchestrator went away: `client.AsyncClient` resumes each exactly, as it resumes a broken
Generate stream). A server without GenerateMany (UNIMPLEMENTED) gets plain Generate calls from
then on. A generation's timeout is kept here: past it the generation is cancelled on the server
and its call raises DEADLINE_EXCEEDED. A caller that stops reading (its task cancelled) cancels
its generation on the server too.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from specdec.runtime.errors import REQUEST_ID_KEY, RETRY_AFTER_KEY, status_code
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

_END = object()


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


def _failure(event: pb.TaggedResponse) -> grpc.aio.AioRpcError:
    """A generation's error event as the AioRpcError its Generate call would raise (trailing
    metadata included: the request id, and retry-after on a RESOURCE_EXHAUSTED that may pass)."""
    trailing = ((REQUEST_ID_KEY, event.request_id),) if event.request_id else ()
    if event.retry_after_s:
        trailing += ((RETRY_AFTER_KEY, str(event.retry_after_s)),)
    return rpc_error(status_code(event.code), event.message, trailing)


class MuxCall:
    """One generation on a shared stream: an async iterator of its GenerateResponses."""

    def __init__(self, mux: Multiplexed, gid: int, request: pb.GenerateRequest, timeout: float | None) -> None:
        self._mux, self.id, self.request = mux, gid, request
        self._timeout = timeout
        self.events: asyncio.Queue = asyncio.Queue()  # GenerateResponse, an error, or _END
        self._fallback: Any = None  # a plain Generate call (a server without GenerateMany)
        self._done = False
        # The deadline: one timer for the generation that adds DEADLINE_EXCEEDED to its events, not a
        # timed wait per event (asyncio.wait_for makes a task of each; this runs per chunk).
        self._timer = None if timeout is None else asyncio.get_running_loop().call_later(max(0.0, timeout),
                                                                                         self._expire)

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[pb.GenerateResponse]:
        try:
            while True:
                if self._fallback is not None:
                    async for response in self._fallback:
                        yield response
                    return
                event = await self._next()
                if event is _END:
                    return
                if isinstance(event, BaseException):
                    if isinstance(event, grpc.aio.AioRpcError) and event.code() == grpc.StatusCode.UNIMPLEMENTED:
                        self._fallback = self._mux.plain(self.request, self._timeout)
                        continue
                    raise event
                yield event
        finally:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            self._mux.forget(self.id, cancel=self._fallback is None)

    async def _next(self) -> Any:
        return await self.events.get()

    def _expire(self) -> None:
        """Past the deadline: the generation ends with DEADLINE_EXCEEDED (and is cancelled on the
        server as its caller stops reading)."""
        if not self._done and self._fallback is None:
            self.events.put_nowait(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> bool:
        """Stop the generation (no further events)."""
        if self._fallback is not None:
            return self._fallback.cancel()
        if self._timer is not None:
            self._timer.cancel()
        self._mux.forget(self.id, cancel=True)
        if not self._done:
            self.events.put_nowait(rpc_error(grpc.StatusCode.CANCELLED, "Cancelled"))
        return True


class _Opened:
    """One opened GenerateMany stream: what goes out on it, and its live generations."""

    def __init__(self) -> None:
        self.outgoing: asyncio.Queue = asyncio.Queue()  # GenerateManyRequests; None half-closes
        self.live: dict[int, MuxCall] = {}
        self.call: Any = None
        self.reader: asyncio.Task | None = None

    async def requests(self) -> AsyncIterator[pb.GenerateManyRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message


class Multiplexed:
    """One channel's GenerateMany stream and the generations on it (see the module docstring).

    A stream is half-closed once it has no live generation (it ends when the server has sent
    everything), and the next generation opens another: an idle client holds no stream open.
    """

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] | None = None) -> None:
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        self._metadata = metadata
        self._ids = itertools.count(1)
        self._open: _Opened | None = None  # the stream new generations go on
        self._streams: dict[int, _Opened] = {}  # generation id -> its stream
        self._plain = False  # the server has no GenerateMany
        self.opened = 0  # streams opened so far

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Any:
        """A MuxCall for the generation (a plain Generate call where the server has no GenerateMany)."""
        if self._plain:
            return self.plain(request, timeout)
        call = MuxCall(self, next(self._ids), request, timeout)
        stream = self._ensure()
        stream.live[call.id] = call
        self._streams[call.id] = stream
        stream.outgoing.put_nowait(pb.GenerateManyRequest(id=call.id, request=request))
        return call

    @property
    def idle(self) -> bool:
        """No generation is live on it."""
        return not self._streams

    def plain(self, request: pb.GenerateRequest, timeout: float | None) -> Any:
        return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)

    def forget(self, gid: int, *, cancel: bool) -> None:
        """The generation is over for its caller; `cancel` tells the server to stop it, if it runs."""
        stream = self._streams.pop(gid, None)
        if stream is None:
            return
        if stream.live.pop(gid, None) is not None and cancel:
            stream.outgoing.put_nowait(pb.GenerateManyRequest(id=gid, cancel=True))
        self._idle(stream)

    def _idle(self, stream: _Opened) -> None:
        if not stream.live and stream is self._open:
            self._open = None
            stream.outgoing.put_nowait(None)  # half-close: the server ends the stream

    def _ensure(self) -> _Opened:
        if self._open is None:
            stream = self._open = _Opened()
            stream.call = self._stub.GenerateMany(stream.requests(), metadata=self._metadata)
            stream.reader = asyncio.get_running_loop().create_task(self._read(stream))
            self.opened += 1
        return self._open

    async def _read(self, stream: _Opened) -> None:
        """Hand each event to its generation; when the stream ends, fail whoever still waits."""
        failure: BaseException
        try:
            async for response in stream.call:
                for event in response.events:
                    self._deliver(stream, event)
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, "the GenerateMany stream ended")
        except grpc.aio.AioRpcError as exc:
            failure = exc
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._plain = True
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.CANCELLED, "the client closed")
        if self._open is stream:
            self._open = None
        live, stream.live = stream.live, {}
        for gid, call in live.items():
            self._streams.pop(gid, None)
            call.events.put_nowait(failure)

    def _deliver(self, stream: _Opened, event: pb.TaggedResponse) -> None:
        call = stream.live.get(event.id)
        if call is None:
            return  # cancelled here already
        if event.HasField("response"):
            call.events.put_nowait(event.response)
        if event.code:
            call.events.put_nowait(_failure(event))
        if event.end:
            if not event.code:
                call.events.put_nowait(_END)
            del stream.live[event.id]
            self._streams.pop(event.id, None)
            self._idle(stream)

    async def close(self) -> None:
        """End every stream (the generations still on them fail with CANCELLED)."""
        streams = {id(s): s for s in [*self._streams.values(), *([self._open] if self._open else [])]}
        for stream in streams.values():
            stream.call.cancel()
        await asyncio.gather(*(s.reader for s in streams.values()), return_exceptions=True)

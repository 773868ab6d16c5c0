"""GenerateMany: many generations over one stream, their events packed into one message per moment.

On a Generate stream each chunk is a gRPC message of its own, and at millisecond rounds and many
streams that per-message work (a write, a system call, the caller's read) costs the orchestrator
and its caller more than the round's Python. A caller that runs many generations at once (the
gateway, a load generator) can instead open one GenerateMany stream and start each generation on
it under an id it picks. Each generation runs exactly as its Generate call would (the same quota,
bounds, loop and responses: `start`); the `Multiplexer` gathers the events that come in the same
moment and sends them as one GenerateManyResponse. The streams of one target batch commit in the
same turn of the event loop, so a round of N streams is one message, not N.

Gathering: when an event comes, the sender lets the event loop run until a turn adds nothing
more (at most SETTLE_TURNS turns), then sends what is held. No timer: an event never waits for
a round that has not committed yet.

Each generation counts as one call of GenerateMany in specdec_requests_total, by its status.
Each generation ends with an event marked `end`: after its last response, or carrying the status
its Generate call would have ended with (`code`, `message`), which ends that generation only. A
`cancel` stops one generation; the caller half-closing its side lets the live ones finish, then
the stream ends; the stream cancelled (or broken) stops all of them. Backpressure: while more
than MAX_HELD events wait for the caller to read them, every generation waits before adding more.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable

from specdec.runtime.errors import InvalidArgument, new_request_id, status_for
from specdec.runtime.server import observe_call
from specdec.v1 import orchestrator_pb2 as pb

METHOD = "/specdec.v1.Orchestrator/GenerateMany"
SETTLE_TURNS = 4  # event-loop turns a gathered message waits for more events, at most
MAX_HELD = 4096  # events held for the caller before generations wait for it to read

Start = Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]]


class Multiplexer:
    """One GenerateMany stream: its live generations and the events they have not sent yet."""

    def __init__(self, start: Start) -> None:
        self._start = start
        self._live: dict[int, asyncio.Task] = {}
        self._held: list[pb.TaggedResponse] = []
        self._ready = asyncio.Event()  # something is held
        self._room = asyncio.Event()  # fewer than MAX_HELD are held
        self._room.set()

    async def serve(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> AsyncIterator[pb.GenerateManyResponse]:
        """The stream's responses, until the caller is done and every generation has ended."""
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                await self._ready.wait()
                await self._settle()
                events, self._held = self._held, []
                self._ready.clear()
                self._room.set()
                if events:
                    yield pb.GenerateManyResponse(events=events)
                if reader.done() and not self._live and not self._held:
                    reader.result()  # the caller's stream failed: its error is the stream's
                    return
        finally:
            reader.cancel()
            tasks = list(self._live.values())
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _settle(self) -> None:
        """Let the generations that commit in this moment add their events."""
        for _ in range(SETTLE_TURNS):
            held = len(self._held)
            await asyncio.sleep(0)
            if len(self._held) == held:
                return

    async def _read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        try:
            async for message in requests:
                if message.cancel:
                    task = self._live.pop(message.id, None)
                    if task is not None:
                        task.cancel()
                elif not message.HasField("request"):
                    self._fail(message.id, InvalidArgument("GenerateMany: a message starts a generation (request) "
                                                           "or cancels one (cancel)"))
                elif message.id in self._live:
                    self._fail(message.id, InvalidArgument(f"GenerateMany: generation {message.id} is still live "
                                                           "on this stream; ids are unique among live ones"))
                else:
                    self._live[message.id] = asyncio.get_running_loop().create_task(
                        self._generate(message.id, message.request))
        finally:
            self._ready.set()  # the sender checks whether the stream is over

    async def _generate(self, gid: int, request: pb.GenerateRequest) -> None:
        try:
            async for response in self._start(request):
                await self._put(pb.TaggedResponse(id=gid, response=response))
            self._hold(pb.TaggedResponse(id=gid, end=True))
            observe_call(METHOD, "OK")
        except asyncio.CancelledError:
            observe_call(METHOD, "CANCELLED")
            raise  # cancelled by the caller (no further events) or with the stream
        except Exception as exc:  # noqa: BLE001 - its status, as Generate's would be (specdec.runtime.errors)
            self._fail(gid, exc)
        finally:
            if self._live.get(gid) is asyncio.current_task():
                del self._live[gid]
            self._ready.set()

    def _fail(self, gid: int, exc: BaseException) -> None:
        request_id = new_request_id()
        code, message = status_for(exc, METHOD, request_id)
        observe_call(METHOD, code.name)
        retry_after = getattr(exc, "retry_after_s", 0.0)
        self._hold(pb.TaggedResponse(id=gid, code=code.value[0], message=message, end=True, request_id=request_id,
                                     retry_after_s=max(1, math.ceil(retry_after)) if retry_after > 0 else 0))

    async def _put(self, event: pb.TaggedResponse) -> None:
        while not self._room.is_set():
            await self._room.wait()
        self._hold(event)

    def _hold(self, event: pb.TaggedResponse) -> None:
        self._held.append(event)
        self._ready.set()
        if len(self._held) >= MAX_HELD:
            self._room.clear()


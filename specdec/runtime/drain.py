"""Graceful drain of a model service on SIGTERM.

Once `Drain.begin()` has run (server.serve calls it on SIGTERM, right after
health turns NOT_SERVING and before the registry entry is deleted), every new
call to a gated method -- the role's Score or Propose, not Release, GetInfo or
health -- is refused with UNAVAILABLE and a message starting "draining:". The
orchestrator treats that as a replica that is gone: it moves the session to
another replica and resends its committed tokens from position 0 (the draft
proposer moves too, or falls back to target-only), so the text is unchanged.

Calls already running when the drain began finish normally. The server then
exits once none is running and no gated call has arrived for `quiet_s`
(every live session that still pointed here has been refused once, i.e.
moved), or at the drain deadline (--grace), whichever comes first.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import grpc

from specdec.runtime.errors import Unavailable

log = logging.getLogger(__name__)

DRAINING_PREFIX = "draining:"
QUIET_S = 0.5  # no gated call for this long: every live session has moved


class Draining(Unavailable):
    """This replica is shutting down: move the session elsewhere (message starts "draining:")."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{DRAINING_PREFIX} {reason}")


def is_draining(details: str | None) -> bool:
    """True for the details string of a call a draining replica refused."""
    return (details or "").startswith(DRAINING_PREFIX)


class Drain:
    """Counts calls to the gated methods; refuses new ones once the drain has begun."""

    def __init__(self, gated: Collection[str], *, quiet_s: float = QUIET_S) -> None:
        self.gated = frozenset(gated)  # full method paths, e.g. /specdec.v1.TargetService/Score
        self.quiet_s = quiet_s
        self.draining = False
        self.in_flight = 0
        self.refused = 0
        self._last_call = 0.0  # monotonic time a gated call last arrived
        self._idle = asyncio.Event()
        self._idle.set()
        self.began = asyncio.Event()  # set by begin(): long-lived streams finish their batches and end

    @classmethod
    def for_service(cls, full_name: str, *, ungated: Collection[str] = ("Release", "GetInfo")) -> Drain:
        """A drain gating every method of the service `full_name` (e.g. specdec.v1.TargetService)
        but `ungated` (its descriptor must be imported)."""
        from google.protobuf import descriptor_pool

        service = descriptor_pool.Default().FindServiceByName(full_name)
        return cls([f"/{full_name}/{m.name}" for m in service.methods if m.name not in ungated])

    def begin(self) -> None:
        """Refuse new gated calls from now on. The quiet period counts from the last gated call,
        not from here: a replica that saw none for quiet_s has no stream mid-round to move,
        and exits at once (a stop of an idle service waited out the period for nothing)."""
        self.draining = True
        self.began.set()

    async def wait(self, deadline_s: float) -> bool:
        """Until no gated call runs and none arrived for quiet_s; False if `deadline_s` passed first."""
        end = time.monotonic() + deadline_s
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                return False
            quiet_left = self._last_call + self.quiet_s - time.monotonic()
            if self.in_flight == 0 and quiet_left <= 0:
                return True
            await asyncio.sleep(max(0.01, min(quiet_left, remaining)))

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _DrainInterceptor(self)

    def _enter(self, method: str) -> None:
        self._last_call = time.monotonic()
        if self.draining:
            self.refused += 1
            raise Draining(f"this replica is shutting down; {method} must go to another replica")
        self.in_flight += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


class _DrainInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the gated unary methods with Drain's count and refusal.

    It sits inside the error-mapping interceptor, so a refusal (Draining, an
    Unavailable) leaves as UNAVAILABLE with its "draining:" message.
    """

    def __init__(self, drain: Drain) -> None:
        self.drain = drain

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self.drain.gated or not handler.unary_unary:
            return handler
        inner = handler.unary_unary
        drain = self.drain

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            drain._enter(method)
            try:
                return await inner(request, context)
            finally:
                drain._exit()

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

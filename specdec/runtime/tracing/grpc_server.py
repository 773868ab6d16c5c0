"""The server side of tracing: read the caller's traceparent, span each specdec call.

Unary calls (Score, Propose, Release, GetInfo, Check, EndSession) get a SERVER
span under the caller's context. A call whose response carries the service's
own timing (Score, Propose) is given exactly that duration — its span equals
Stats' target_ms / draft_ms — with `queue` and `forward` children of the
reported durations (placed from the call's start: the request decode before
them takes microseconds). Server-streaming calls (Generate) only hand the
caller's context on: the loop's request span (specdec.runtime.tracing.RequestTrace)
is timed by the Tally's clock.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import propagate

from specdec.runtime import tracing

_PREFIX = "/specdec.v1."


class TracingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, address: str) -> None:
        self.address = address

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_PREFIX):
            return handler  # health, reflection: not traced
        carrier = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        remote = propagate.extract(carrier) if "traceparent" in carrier else None
        name = details.method[1:]  # specdec.v1.TargetService/Score
        if remote is None and name.endswith("/GetInfo"):
            return handler  # start-up and discovery probes: no trace of their own
        address = self.address

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                span = tracing._start(name, remote, start, "SERVER", _request_attributes(request, address))
                tracing._set_parent(tracing._context_of(span))  # this call's own RPCs (Check) nest here
                try:
                    response = await inner_uu(request, context)
                except BaseException as exc:
                    tracing._error(span, exc)
                    span.set_attribute("specdec.cache_miss", type(exc).__name__ == "CacheMiss")
                    span.end(end_time=tracing.epoch_ns(time.perf_counter()))
                    raise
                _finish(span, start, response)
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)

        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                tracing._set_parent(remote)
                async for response in inner_us(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


def _request_attributes(request: Any, address: str) -> dict:
    attributes: dict[str, Any] = {"rpc.system": "grpc", "server.address": address}
    for field in ("session_id", "cache_position", "k"):
        if hasattr(request, field):
            attributes[f"specdec.{field}"] = getattr(request, field)
    if hasattr(request, "tokens"):
        attributes["specdec.tokens"] = len(request.tokens)
    return attributes


def _finish(span, start: float, response: Any) -> None:
    timing = getattr(response, "timing", None)
    if timing is None or not timing.total_ms:
        span.end(end_time=tracing.epoch_ns(time.perf_counter()))
        return
    if hasattr(response, "cache_length"):
        span.set_attribute("specdec.cache_length", response.cache_length)
    span.set_attributes({"specdec.queue_ms": timing.queue_ms, "specdec.forward_ms": timing.forward_ms,
                         "specdec.total_ms": timing.total_ms})
    ctx = tracing._context_of(span)
    queued = start + timing.queue_ms / 1e3
    tracing._start("queue", ctx, start).end(end_time=tracing.epoch_ns(queued))
    tracing._start("forward", ctx, queued).end(end_time=tracing.epoch_ns(queued + timing.forward_ms / 1e3))
    span.end(end_time=tracing.epoch_ns(start + timing.total_ms / 1e3))

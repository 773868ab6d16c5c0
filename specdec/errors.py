"""Errors every specdec server raises, and their one mapping to gRPC statuses.

Domain code raises these (never `context.abort`); `ErrorInterceptor` turns
them into statuses in one place. Anything else escaping a handler is a bug:
it becomes INTERNAL and its traceback is logged.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class SpecdecError(Exception):
    """Base class: a failure with a gRPC status the caller can act on."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(SpecdecError, ValueError):
    """The request itself is wrong; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(SpecdecError):
    """A valid request that runs past a limit, e.g. the context length."""

    code = grpc.StatusCode.OUT_OF_RANGE


CACHE_MISS_PREFIX = "cache miss:"


class CacheMiss(SpecdecError):
    """The service does not hold the prefix the caller named.

    Recoverable: resend every committed token with cache_position = 0.
    The message always starts with "cache miss:".
    """

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, reason: str):
        super().__init__(f"{CACHE_MISS_PREFIX} {reason}")


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(SpecdecError):
    """Too big for this server (request size, memory budget)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecdecError):
    """Transient: a dependency is down or the server is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


def is_cache_miss(error: grpc.RpcError) -> bool:
    """True when a client-side RpcError is the documented cache-miss status."""
    return (
        error.code() == grpc.StatusCode.FAILED_PRECONDITION
        and (error.details() or "").startswith(CACHE_MISS_PREFIX)
    )


def _status_for(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SpecdecError):
        return exc.code, str(exc)
    log.error("unexpected error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to gRPC statuses.

    `observe(method, code_name)` is called once per finished call (e.g. to
    count requests by status); it must not raise.
    """

    def __init__(self, observe: Callable[[str, str], None] | None = None):
        self._observe = observe or (lambda method, code: None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        observe = self._observe

        async def fail(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
            code, details = _status_for(exc, method)
            observe(method, code.name)
            await context.abort(code, details)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    response = await inner_uu(request, context)
                except grpc.aio.AbortError:
                    raise  # the handler already set its status
                except Exception as exc:  # noqa: BLE001 - this is the one mapping point
                    await fail(exc, context)
                observe(method, "OK")
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def unary_stream(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                try:
                    async for response in inner_us(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await fail(exc, context)
                observe(method, "OK")

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        # Streaming handlers written with context.write (health Watch) and
        # client-streaming ones (reflection): none of ours; pass through.
        return handler

"""Errors every specdec server raises, and their one mapping to gRPC statuses.

Domain code raises these (never `context.abort`); `ErrorInterceptor` turns
them into statuses in one place. Anything else escaping a handler is a bug:
it becomes INTERNAL and its traceback is logged.

What a client reads is the error's message: it names the offending field and
never holds addresses, credentials or exception class names. Details for the
operator go in `detail`, logged with the call's request id, which every reply
carries in its trailing metadata (`x-request-id`). A request that does not
decode (garbage bytes, invalid UTF-8 in a string field) is INVALID_ARGUMENT.
"""
from __future__ import annotations

import inspect
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class SpecdecError(Exception):
    """Base class: a failure with a gRPC status the caller can act on."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail  # for the server log only, never sent to the client


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

    def __init__(self, reason: str, *, detail: str = ""):
        super().__init__(f"{CACHE_MISS_PREFIX} {reason}", detail=detail)


class FailedPrecondition(SpecdecError):
    """The system is not in a state the request needs (and retrying alone will not help)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(SpecdecError):
    """Too big for this server (request size, memory budget), or over a limit for now (load).

    `retry_after_s` > 0: when retrying may succeed, sent back as `retry-after`
    trailing metadata (whole seconds).
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str = "", *, detail: str = "", retry_after_s: float = 0.0) -> None:
        super().__init__(message, detail=detail)
        self.retry_after_s = retry_after_s


class Unavailable(SpecdecError):
    """Transient: a dependency is down or the server is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecdecError):
    """A server-side time limit passed (a stream's --max-stream-seconds)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(SpecdecError):
    """No credentials were sent."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SpecdecError):
    """Credentials were sent but are not accepted."""

    code = grpc.StatusCode.PERMISSION_DENIED


REQUEST_ID_KEY = "x-request-id"
RETRY_AFTER_KEY = "retry-after"  # trailing metadata of a RESOURCE_EXHAUSTED that may pass later
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class _Undecodable:
    """Stands in for a request whose bytes did not parse; the handler wrapper rejects it."""

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends: the bytes are bad
            return _Undecodable(str(exc))

    return deserialize


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def _request_id(context: grpc.aio.ServicerContext) -> str:
    """The caller's x-request-id when it is a sane token, else a fresh one."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and _REQUEST_ID_RE.match(value):
            return value
    return new_request_id()


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The StatusCode of a status number carried in a message (UNKNOWN for one this grpc lacks)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def is_cache_miss(error: grpc.RpcError) -> bool:
    """True when a client-side RpcError is the documented cache-miss status."""
    return (
        error.code() == grpc.StatusCode.FAILED_PRECONDITION
        and (error.details() or "").startswith(CACHE_MISS_PREFIX)
    )


_QUIET = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
          grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


def status_for(exc: BaseException, method: str, request_id: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, SpecdecError):
        level = logging.DEBUG if exc.code in _QUIET else logging.WARNING
        log.log(level, "request %s %s: %s: %s%s", request_id, method, exc.code.name, exc,
                f" ({exc.detail})" if exc.detail else "")
        return exc.code, str(exc)
    log.error("request %s %s: unexpected error", request_id, method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to gRPC statuses.

    `observe(method, code_name)` is called once per finished call (e.g. to
    count requests by status); it must not raise. `guard(method, metadata,
    auth_context)` runs before each handler, whatever the handler's shape
    (authentication: what it raises is the call's status; a shape this class
    does not know is refused, never passed through). Every call gets a
    request id, returned in trailing metadata.
    """

    def __init__(self, observe: Callable[[str, str], None] | None = None,
                 guard: Callable[[str, Any], None] | None = None):
        self._observe = observe or (lambda method, code: None)
        self._guard = guard

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
        guard = self._guard
        deserializer = _tolerant(handler.request_deserializer)

        def admit(request: Any, context: grpc.aio.ServicerContext) -> str:
            """The call's request id (in its trailing metadata); raises unless authenticated and decoded."""
            request_id = _request_id(context)
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            return request_id

        def authenticate(context: grpc.aio.ServicerContext) -> None:
            if guard is not None:
                guard(method, context.invocation_metadata(), context.auth_context())

        def check(request: Any, context: grpc.aio.ServicerContext) -> None:
            authenticate(context)
            if isinstance(request, _Undecodable):
                raise InvalidArgument("the request could not be decoded as its protobuf "
                                      "message", detail=request.error)

        async def fail(exc: BaseException, context: grpc.aio.ServicerContext,
                       request_id: str) -> None:
            code, details = status_for(exc, method, request_id)
            retry_after = getattr(exc, "retry_after_s", 0.0)
            if retry_after > 0:
                context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),
                                               (RETRY_AFTER_KEY, str(max(1, math.ceil(retry_after))))))
            observe(method, code.name)
            await context.abort(code, details)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                request_id = admit(request, context)
                try:
                    check(request, context)
                    response = await inner_uu(request, context)
                except grpc.aio.AbortError:
                    raise  # the handler already set its status
                except Exception as exc:  # noqa: BLE001 - this is the one mapping point
                    await fail(exc, context, request_id)
                observe(method, "OK")
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )

        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def unary_stream(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                request_id = admit(request, context)
                try:
                    check(request, context)
                    async for response in inner_us(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await fail(exc, context, request_id)
                observe(method, "OK")

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )

        # Streaming handlers written with context.write (health Watch) and
        # client-streaming ones (reflection): none of ours, but the guard runs first all
        # the same (fail closed: a method is open only where the guard says so).
        async def admitted(context: grpc.aio.ServicerContext) -> None:
            request_id = admit(None, context)
            try:
                authenticate(context)
            except Exception as exc:  # noqa: BLE001
                await fail(exc, context, request_id)

        return _guarded(handler, admitted)


_OTHER_SHAPES = (("unary_stream", grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler))


def _guarded(handler: grpc.RpcMethodHandler,
             admitted: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> grpc.RpcMethodHandler:
    """`handler` with `admitted(context)` awaited before it runs (it aborts the call when the
    caller is not admitted); a handler of no known shape is refused."""
    for shape, make in _OTHER_SHAPES:
        inner = getattr(handler, shape)
        if inner is None:
            continue
        if inspect.isasyncgenfunction(inner):
            async def streamed(request: Any, context: grpc.aio.ServicerContext,
                               inner=inner) -> AsyncIterator[Any]:
                await admitted(context)
                async for response in inner(request, context):
                    yield response

            wrapped = streamed
        else:
            async def returned(request: Any, context: grpc.aio.ServicerContext, inner=inner) -> Any:
                await admitted(context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

            wrapped = returned
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    async def refused(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this method has no handler")

    return grpc.unary_unary_rpc_method_handler(refused)

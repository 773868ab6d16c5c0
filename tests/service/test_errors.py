"""specdec.runtime.errors: one interceptor maps every exception to its gRPC status."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.runtime.errors import (
    CacheMiss,
    ErrorInterceptor,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
    is_cache_miss,
)

RAISES = {
    "invalid": InvalidArgument("tokens[3] = 999 is outside the vocabulary"),
    "range": OutOfRange("context length"),
    "miss": CacheMiss("session 's' holds nothing here"),
    "missing": NotFound("no such session"),
    "big": ResourceExhausted("too many tokens"),
    "down": Unavailable("draft service down"),
    "bug": RuntimeError("a bug"),
}
EXPECTED = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "range": grpc.StatusCode.OUT_OF_RANGE,
    "miss": grpc.StatusCode.FAILED_PRECONDITION,
    "missing": grpc.StatusCode.NOT_FOUND,
    "big": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "down": grpc.StatusCode.UNAVAILABLE,
    "bug": grpc.StatusCode.INTERNAL,
}


def _identity(b: bytes) -> bytes:
    return b


async def _unary(request: bytes, context) -> bytes:
    if request.decode() in RAISES:
        raise RAISES[request.decode()]
    return b"ok:" + request


async def _stream(request: bytes, context):
    yield b"first"
    raise RAISES[request.decode()]


async def _call_all() -> dict:
    seen: list[tuple[str, str]] = []
    server = grpc.aio.server(interceptors=[ErrorInterceptor(lambda m, c: seen.append((m, c)))])
    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _identity, _identity),
    })
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary("/test.Echo/Unary", _identity, _identity)
            stream = channel.unary_stream("/test.Echo/Stream", _identity, _identity)
            out["ok"] = await unary(b"hello", timeout=10)
            for name in RAISES:
                try:
                    await unary(name.encode(), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    out[name] = exc
            got = []
            try:
                async for item in stream(b"down", timeout=10):
                    got.append(item)
            except grpc.aio.AioRpcError as exc:
                out["stream"] = (got, exc)
    finally:
        await server.stop(0)
    out["seen"] = seen
    return out


def test_every_error_maps_to_its_status() -> None:
    out = asyncio.run(_call_all())
    assert out["ok"] == b"ok:hello"
    for name, code in EXPECTED.items():
        assert out[name].code() == code, name
    assert out["invalid"].details() == "tokens[3] = 999 is outside the vocabulary"
    assert is_cache_miss(out["miss"]) and not is_cache_miss(out["invalid"])
    assert out["miss"].details().startswith("cache miss: session")
    # A bug: no exception class or text reaches the client, only the request id
    # that the server log files the traceback under (also in trailing metadata).
    request_id = dict(out["bug"].trailing_metadata())["x-request-id"]
    assert out["bug"].details() == f"internal error (request id {request_id})"
    got, exc = out["stream"]
    assert got == [b"first"] and exc.code() == grpc.StatusCode.UNAVAILABLE
    codes = [c for m, c in out["seen"] if m == "/test.Echo/Unary"]
    assert codes.count("OK") == 1 and "INTERNAL" in codes and "FAILED_PRECONDITION" in codes


def test_cache_miss_message_prefix() -> None:
    assert str(CacheMiss("x")) == "cache miss: x"
    with pytest.raises(InvalidArgument):
        raise InvalidArgument("a")
    assert issubclass(InvalidArgument, ValueError)

"""Errors in the OpenAI JSON shape, and the one mapping from gRPC statuses to HTTP codes.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": "invalid_argument"}}

A RESOURCE_EXHAUSTED that carries a `retry-after` hint in its trailing
metadata (an admission limit: overload, rate, concurrency) becomes HTTP 429
with a `Retry-After` header of the same whole seconds.
"""
from __future__ import annotations

import json
import re

import grpc
from starlette.responses import Response

from specdec.runtime.errors import RETRY_AFTER_KEY

# gRPC status -> HTTP status (the usual gateway mapping).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 429: "rate_limit_error"}

# The orchestrator's messages start with the field they are about ("max_new_tokens: ...",
# "sampling.temperature must be ..."); these are the OpenAI names of those fields.
_PARAMS = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature",
           "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.min_p": "min_p",
           "stop": "stop", "k": "speculation.k", "proposer": "speculation.proposer",
           "proposer_name": "speculation.proposer",
           "guess": "speculation.guess", "session_id": "session_id", "seed": "seed",
           "prediction": "prediction", "n": "n", "keep_session": "keep_session",
           "constraint.json_schema": "response_format", "constraint.json_object": "response_format",
           "constraint.regex": "constraint.regex", "constraint.lark": "constraint.lark",
           "top_logprobs": "top_logprobs", "logprobs": "logprobs", "ignore_eos": "ignore_eos",
           "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids", "tools": "tools"}
_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?)(?::| must)")
# A message's field ("messages[2].tool_calls: ...") is about the messages.
_MESSAGE = re.compile(r"^messages\[\d+\]")


class APIError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_rpc_error(exc: grpc.RpcError, prompt_param: str = "messages") -> APIError:
    """The HTTP form of a failed orchestrator call, keeping its message.

    `prompt_param` names the prompt in this endpoint ("messages" or "prompt").
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    match = _FIELD.match(details)
    param = _PARAMS.get(match.group(1)) if match else None
    if param is None and (details.startswith("prompt") or _MESSAGE.match(details)):
        param = prompt_param
    retry_after = _retry_after(exc) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    return APIError(HTTP_STATUS.get(code, 500), details, param=param, code=code.name.lower(),
                    headers={"Retry-After": retry_after} if retry_after else None)


def _retry_after(exc: grpc.RpcError) -> str | None:
    """The orchestrator's `retry-after` trailing metadata (whole seconds), if any."""
    try:
        trailing = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error without metadata
        return None
    for key, value in trailing:
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return str(value)
    return None


async def first_chunk(stream, prompt_param: str = "messages"):
    """(first chunk or None, the rest) of a client stream, waiting for the first one so that a
    request the orchestrator rejects still gets its HTTP status: its error as an APIError."""
    events = stream.__aiter__()
    try:
        return await events.__anext__(), events
    except StopAsyncIteration:
        return None, events
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, prompt_param) from None
    except BaseException:
        stream.cancel()
        raise

"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API over the chat path.

A turn is a chat request (gateway.responses.translate) on one Generate stream (gateway.generation).
With `store` (the default) its conversation is a kept session: the next turn, naming it in
`previous_response_id`, sends the whole conversation again with that session's id, and the
services serve the shared prefix from their KV caches (usage.input_tokens_details.cached_tokens).
The record (gateway.responses.kept) is the caller's; another caller's id is a 404 like an unknown one.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse, Response

from gateway import state
from gateway.responses import kept
from gateway.chunks import DISCONNECTS, choice_stats
from gateway.errors import APIError, first_chunk, from_rpc_error
from gateway.generation import body, call_options, collect, metadata as caller, unless_disconnected
from gateway.responses.translate import (
    ResponsesRequest, ResponseWriter, assistant_message, chat_request, input_messages, parse_request, skeleton,
)
from gateway.schemas import ErrorResponse, ResponseDeleted, ResponseEvent, ResponseObject, request_body, responses

router = APIRouter()
PROMPT = "input"  # what the orchestrator's prompt errors name here


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest),
             responses=responses(ResponseObject, ResponseEvent))
async def create(request: Request) -> Response:
    gw = state.of(request)
    req = parse_request(await body(request))
    who = kept.owner(request.headers.get("authorization"))
    previous = _stored(gw, req.previous_response_id, who, "previous_response_id") \
        if req.previous_response_id else None
    messages = (previous.history if previous else []) + input_messages(req)
    store = bool(req.store) and gw.settings.max_stored_responses > 0
    session = previous.session_id if previous and store else ""
    metadata = caller(request)
    options, plan = await call_options(gw, chat_request(req, messages, session_id=session, keep=store), metadata)
    writer = ResponseWriter(skeleton(f"resp_{uuid.uuid4().hex}", req, gw.served.primary), plan)

    def save() -> None:
        stats = stream.choice_stats.get(0)
        if store and stats is not None:
            gw.stored.put(kept.StoredResponse(
                id=writer.response["id"], owner=who, body=writer.response,
                history=messages + [assistant_message(writer.response)], session_id=stats.session_id))

    async def opened():
        """The first chunk; a stored session the orchestrator no longer has (its TTL passed,
        or Redis lost it) starts a new one with the whole conversation: the same text."""
        nonlocal stream
        try:
            return await first_chunk(stream, PROMPT)
        except APIError as exc:
            if not (options["session_id"] and exc.status == 404 and exc.param == "session_id"):
                raise
        options["session_id"] = ""
        stream = gw.client.generate(metadata=metadata, **options)
        return await first_chunk(stream, PROMPT)

    stream = gw.client.generate(metadata=metadata, **options)
    if not req.stream:
        async def whole() -> Response:
            first, events = await opened()
            texts, _ = await collect(first, events, stream, 1, PROMPT)
            writer.opening()
            writer.push(texts[0])
            writer.finish(choice_stats(stream, 1)[0])
            save()
            return JSONResponse(writer.response)

        return await unless_disconnected(request, stream, whole())
    started = await unless_disconnected(request, stream, opened())
    if isinstance(started, Response):
        return started
    return EventSourceResponse(_events(writer, *started, lambda: stream, save), sep="\n", ping=15,
                               shutdown_grace_period=gw.settings.grace_s)


async def _events(writer: ResponseWriter, first, pieces, current, save):
    """The SSE events of one streamed response (`current()`: its Generate stream)."""
    finished = False
    try:
        for event in writer.opening() + (writer.push(first.text) if first is not None else []):
            yield _sse(event)
        async for piece in pieces:
            for event in writer.push(piece.text):
                yield _sse(event)
        events = writer.finish(choice_stats(current(), 1)[0])
        save()
        for event in events:
            yield _sse(event)
        finished = True
    except (grpc.RpcError, APIError) as exc:
        finished = True
        err = from_rpc_error(exc, PROMPT) if isinstance(exc, grpc.RpcError) else exc
        yield _sse(writer._event("error", message=err.message, code=err.code, param=err.param))
    finally:
        if not finished:
            DISCONNECTS.inc()
        current().cancel()  # a client that left: the orchestrator frees the KV (a kept session stays)


def _sse(event: dict[str, Any]) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event)}


def _stored(gw, ident: str, who: str, param: str) -> kept.StoredResponse:
    record = gw.stored.get(ident, who)
    if record is None:
        raise _not_found(ident, param)
    return record


def _not_found(ident: str, param: str) -> APIError:
    return APIError(404, f"Response with id {ident!r} not found (unknown, expired or not yours).",
                    param=param, code="response_not_found")


_NOT_FOUND = {404: {"model": ErrorResponse, "description": "Unknown, expired or another caller's id"}}


@router.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **_NOT_FOUND})
async def retrieve(response_id: str, request: Request) -> Response:
    gw = state.of(request)
    record = _stored(gw, response_id, kept.owner(request.headers.get("authorization")), "response_id")
    return JSONResponse(record.body)


@router.delete("/v1/responses/{response_id}", responses={200: {"model": ResponseDeleted}, **_NOT_FOUND})
async def delete(response_id: str, request: Request) -> Response:
    """Forget the record; the kept session too, once no other stored response continues it."""
    gw = state.of(request)
    record = gw.stored.delete(response_id, kept.owner(request.headers.get("authorization")))
    if record is None:
        raise _not_found(response_id, "response_id")
    if record.session_id and not gw.stored.names_session(record.session_id):
        try:
            await gw.client.end_session(record.session_id, metadata=caller(request))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, PROMPT) from None
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})

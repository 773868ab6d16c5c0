"""POST /v1/chat/completions and /v1/completions: one Orchestrator.Generate stream each.

The route waits for the stream's first chunk before answering, so a request the orchestrator
rejects gets its HTTP status and an OpenAI error body, streaming or not. A client that
disconnects cancels the gRPC call, and the orchestrator frees the session's KV on both
services: mid-stream (the SSE response notices), or before a response that is not streamed
(the route watches the connection while it waits: uvicorn does not cancel a handler whose
client left). The stream's events are gateway.chunks'; tool calls are gateway.tools'.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import grpc
from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse, Response

from gateway import logprobs, state, tools
from gateway.chunks import DISCONNECTS, Chunks, choice_stats, sse
from gateway.errors import first_chunk, from_rpc_error, invalid
from gateway.protocol import (
    FINISH_REASONS, ChatRequest, CompletionRequest, chat_messages, completion_prompt,
    generate_options, parse, usage,
)
from gateway.schemas import (
    ChatCompletion, ChatCompletionChunk, TextCompletion, request_body, responses,
)

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest),
             responses=responses(ChatCompletion, ChatCompletionChunk))
async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
             responses=responses(TextCompletion, TextCompletion))
async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, *, chat: bool) -> Response:
    gw = state.of(request)
    settings = gw.settings
    req = parse(ChatRequest if chat else CompletionRequest, await _body(request))
    options = generate_options(req, settings.default_max_tokens)
    auth = request.headers.get("authorization")
    metadata = (("authorization", auth),) if auth else None
    info = await gw.served.learn(gw.channel, metadata)
    plan = tools.plan(req, info.tool_call_format if info is not None else None) if chat else None
    options.update(tools.options(plan))
    if chat:
        options["messages"] = chat_messages(req)
    else:
        options["prompt"] = completion_prompt(req)
    gw.served.check(req.model)
    prompt_param = "messages" if chat else "prompt"
    stream = gw.client.generate(metadata=metadata, **options)
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    n, model = options["n"], gw.served.primary
    if not req.stream:
        async def whole() -> Response:
            first, events = await first_chunk(stream, prompt_param)
            texts, entries = await _collect(first, events, stream, n, prompt_param)
            return JSONResponse(_whole(ident, chat, model, texts, choice_stats(stream, n), entries, plan))

        return await _unless_disconnected(request, stream, whole())
    opened = await _unless_disconnected(request, stream, first_chunk(stream, prompt_param))
    if isinstance(opened, Response):
        return opened
    first, events = opened
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    writer = Chunks(ident, chat, n, model, include_usage=include_usage, plan=plan,
                    continuous=include_usage and opts.continuous_usage_stats,
                    prompt_tokens=first.start_index if first is not None else 0)
    body = sse(writer, first, events, stream, prompt_param)
    return EventSourceResponse(body, sep="\n", ping=15, shutdown_grace_period=settings.grace_s)


async def _unless_disconnected(request: Request, stream, work: Awaitable):
    """`work`'s result; cancelled with the gRPC stream (the generation) if the HTTP client
    disconnects first, and then an empty 499 that nobody reads."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not task.done()  # the client left, or this handler is being cancelled
        if left:
            task.cancel()
            stream.cancel()
    if left:
        await asyncio.gather(task, return_exceptions=True)  # its own clean-up
        DISCONNECTS.inc()
        return Response(status_code=499)
    return task.result()


async def _disconnect(request: Request) -> None:
    """Until the HTTP client disconnects (its body was read: the next ASGI message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # a server that sends something else: do not spin


async def _collect(first, events: AsyncIterator, stream, n: int,
                   prompt_param: str) -> tuple[list[str], list[list]]:
    """Each choice's whole text and log-probability entries (a response that is not streamed)."""
    texts: list[list[str]] = [[] for _ in range(n)]
    entries: list[list] = [[] for _ in range(n)]
    if first is not None:
        texts[first.index].append(first.text)
        entries[first.index].extend(first.logprobs)
    try:
        async for chunk in events:
            texts[chunk.index].append(chunk.text)
            entries[chunk.index].extend(chunk.logprobs)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, prompt_param) from None
    finally:
        stream.cancel()  # a no-op once finished; frees the session if we were cancelled
    return ["".join(t) for t in texts], entries


def _whole(ident: str, chat: bool, model: str, texts: list[str], stats: list,
           entries: list[list], plan: tools.ToolPlan | None = None) -> dict:
    choices = []
    for index, (text, st, lps) in enumerate(zip(texts, stats, entries)):
        finish = FINISH_REASONS.get(st.finish_reason, st.finish_reason)
        if chat:
            choices.append({"index": index, "message": tools.message(plan, text),
                            "logprobs": logprobs.chat(lps),
                            "finish_reason": tools.finish_reason(plan, text, finish)})
        else:
            choices.append({"index": index, "text": text, "logprobs": logprobs.completion(lps),
                            "finish_reason": finish})
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage(stats)}


async def _body(request: Request):
    try:
        body = await request.json()
        # "\ud800" is valid JSON but no UTF-8 string: protobuf could not encode it.
        json.dumps(body, ensure_ascii=False).encode()
        return body
    except UnicodeEncodeError:
        raise invalid("the request body holds an unpaired UTF-16 surrogate escape",
                      code="invalid_json") from None
    except ValueError:
        raise invalid("the request body is not valid JSON", code="invalid_json") from None

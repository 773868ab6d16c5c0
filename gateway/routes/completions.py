"""POST /v1/chat/completions and /v1/completions: one Orchestrator.Generate stream each.

Opening, waiting and collecting the stream are gateway.generation's (shared with
/v1/responses); the stream's events are gateway.chunks'; tool calls are gateway.tools'.
"""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse, Response

from gateway import logprobs, state, tools
from gateway.chunks import Chunks, choice_stats, sse
from gateway.errors import first_chunk
from gateway.generation import body, call_options, collect, metadata as caller, unless_disconnected
from gateway.protocol import FINISH_REASONS, ChatRequest, CompletionRequest, parse, usage
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
    req = parse(ChatRequest if chat else CompletionRequest, await body(request))
    metadata = caller(request)
    options, plan = await call_options(gw, req, metadata)
    prompt_param = "messages" if chat else "prompt"
    stream = gw.client.generate(metadata=metadata, **options)
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    n, model = options["n"], gw.served.primary
    if not req.stream:
        async def whole() -> Response:
            first, events = await first_chunk(stream, prompt_param)
            texts, entries = await collect(first, events, stream, n, prompt_param)
            return JSONResponse(_whole(ident, chat, model, texts, choice_stats(stream, n), entries, plan))

        return await unless_disconnected(request, stream, whole())
    opened = await unless_disconnected(request, stream, first_chunk(stream, prompt_param))
    if isinstance(opened, Response):
        return opened
    first, events = opened
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    writer = Chunks(ident, chat, n, model, include_usage=include_usage, plan=plan,
                    continuous=include_usage and opts.continuous_usage_stats,
                    prompt_tokens=first.start_index if first is not None else 0)
    lines = sse(writer, first, events, stream, prompt_param)
    return EventSourceResponse(lines, sep="\n", ping=15, shutdown_grace_period=settings.grace_s)


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

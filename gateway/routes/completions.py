"""POST /v1/chat/completions and /v1/completions: one Orchestrator.Generate stream each.

The route waits for the stream's first chunk before answering, so a request the orchestrator
rejects gets its HTTP status and an OpenAI error body, streaming or not. A client that
disconnects mid-stream cancels the gRPC call, and the orchestrator frees the session's KV on
both services.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import APIRouter, Request
from prometheus_client import Counter
from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse, Response

from gateway import logprobs, state
from gateway.errors import APIError, first_chunk, from_rpc_error, invalid
from gateway.protocol import (
    FINISH_REASONS, ChatRequest, CompletionRequest, chat_messages, completion_prompt,
    generate_options, parse, usage,
)
from gateway.routes.models import no_such_model
from gateway.schemas import (
    ChatCompletion, ChatCompletionChunk, TextCompletion, request_body, responses,
)

_TEXT = "\x00specdec-text\x00"  # placeholder split out of the precomputed chunk JSON

DISCONNECTS = Counter("specdec_http_stream_disconnects_total",
                      "Streams the HTTP client left before the end (generation cancelled)")

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
    if chat:
        options["messages"] = chat_messages(req)
    else:
        options["prompt"] = completion_prompt(req)
    if req.model != settings.model_name:
        raise no_such_model(req.model)
    prompt_param = "messages" if chat else "prompt"
    auth = request.headers.get("authorization")
    metadata = (("authorization", auth),) if auth else None
    stream = gw.client.generate(metadata=metadata, **options)
    first, events = await first_chunk(stream, prompt_param)
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    n = options["n"]
    if not req.stream:
        texts, entries = await _collect(first, events, stream, n, prompt_param)
        return JSONResponse(_whole(ident, chat, settings.model_name, texts,
                                   _choice_stats(stream, n), entries))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    body = _sse(_Chunks(ident, chat, n, settings.model_name, include_usage), first, events,
                stream, prompt_param)
    return EventSourceResponse(body, sep="\n", ping=15, shutdown_grace_period=settings.grace_s)


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
           entries: list[list]) -> dict:
    choices = []
    for index, (text, st, lps) in enumerate(zip(texts, stats, entries)):
        finish = FINISH_REASONS.get(st.finish_reason, st.finish_reason)
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text,
                                                        "refusal": None},
                            "logprobs": logprobs.chat(lps), "finish_reason": finish})
        else:
            choices.append({"index": index, "text": text, "logprobs": logprobs.completion(lps),
                            "finish_reason": finish})
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage(stats)}


class _Chunks:
    """The JSON of one streamed generation's chunks. With n > 1 the choices' chunks interleave,
    each with its `index`; a choice's finish chunk goes out as soon as its Stats has come."""

    def __init__(self, ident: str, chat: bool, n: int, model: str, include_usage: bool) -> None:
        self.chat, self.n, self.include_usage = chat, n, include_usage
        self.base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model, "system_fingerprint": None}
        if include_usage:
            self.base["usage"] = None
        # Text chunks are the precomputed JSON with the text spliced in.
        self.spliced = [self.chunk(i, {"content": _TEXT} if chat else _TEXT).split(json.dumps(_TEXT))
                        for i in range(n)]
        self.ended: set[int] = set()
        self.offsets = [0] * n  # completions' text_offset: characters streamed so far per choice

    def chunk(self, index: int, delta_or_text, finish=None, lps=None) -> str:
        if self.chat:
            choice = {"index": index, "delta": delta_or_text, "logprobs": lps,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta_or_text, "logprobs": lps,
                      "finish_reason": finish}
        return json.dumps({**self.base, "choices": [choice]})

    def opening(self) -> list[str]:
        """Chat's first chunk of each choice: the assistant's role."""
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)
                ] if self.chat else []

    def finished(self, stream) -> list[str]:
        """The finish chunks of the choices whose Stats came since the last call."""
        out = []
        for index in sorted(set(stream.choice_stats) - self.ended):
            self.ended.add(index)
            st = stream.choice_stats[index]
            out.append(self.chunk(index, {} if self.chat else "",
                                  FINISH_REASONS.get(st.finish_reason, st.finish_reason)))
        return out

    def text(self, piece) -> str:
        if piece.logprobs:  # built whole: the log-probabilities ride along
            if self.chat:
                line = self.chunk(piece.index, {"content": piece.text},
                                  lps=logprobs.chat(piece.logprobs))
            else:
                line = self.chunk(piece.index, piece.text,
                                  lps=logprobs.completion(piece.logprobs, self.offsets[piece.index]))
            self.offsets[piece.index] += len(piece.text)
            return line
        head, tail = self.spliced[piece.index]
        return head + json.dumps(piece.text) + tail

    def usage(self, stream) -> str:
        return json.dumps({**self.base, "choices": [], "usage": usage(_choice_stats(stream, self.n))})


async def _sse(chunks: _Chunks, first, events: AsyncIterator, stream,
               prompt_param: str) -> AsyncIterator[str]:
    """`data:` lines of one streamed generation, ending with `[DONE]`."""
    finished = False
    try:
        for line in chunks.opening():
            yield line
        if first is not None and (first.text or first.logprobs):
            yield chunks.text(first)
        async for piece in events:
            for line in chunks.finished(stream):
                yield line
            if piece.text or piece.logprobs:  # an EOS has no text, but its log-probability
                yield chunks.text(piece)
        for line in chunks.finished(stream):
            yield line
        if chunks.include_usage:
            yield chunks.usage(stream)
        yield "[DONE]"
        finished = True
    except grpc.RpcError as exc:
        finished = True
        yield json.dumps(from_rpc_error(exc, prompt_param).body())
    finally:
        if not finished:
            DISCONNECTS.inc()
        # The client went away (this generator is cancelled) or the stream ended:
        # cancelling the call makes the orchestrator release both services' KV.
        stream.cancel()


def _choice_stats(stream, n: int) -> list:
    """The choices' Stats in index order (an orchestrator without n sends one, index 0)."""
    stats = stream.choice_stats
    if sorted(stats) != list(range(n)):
        raise APIError(502, f"the orchestrator sent stats for choices {sorted(stats)} of {n}",
                       code="bad_gateway")
    return [stats[i] for i in range(n)]


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

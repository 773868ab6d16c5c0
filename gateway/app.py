"""The ASGI app: OpenAI-compatible endpoints in front of one orchestrator address.

Every generation is one `Orchestrator.Generate` stream through `client.AsyncClient`;
no model work happens here. The gateway waits for the stream's first chunk before
answering, so a request the orchestrator rejects gets its HTTP status and an OpenAI
error body, streaming or not. A client that disconnects mid-stream cancels the gRPC
call, and the orchestrator frees the session's KV on both services.

Before any route (gateway.guard): a body over --max-body-bytes is a 413 while it is read,
and, while the orchestrator takes calls without a token, only --allowed-hosts names may be
in Host and Origin. /metrics is on its own port (--metrics-port), never on the API's.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter, Histogram
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from client import AsyncClient
from specdec.runtime.security import aio_channel, channel_credentials
from gateway.errors import APIError, first_chunk, from_rpc_error, invalid
from gateway import logprobs, playground
from gateway.guard import LOCAL_HOSTS, BodyLimit, Credentials, HostCheck
from gateway.playground import PlaygroundSettings
from gateway.protocol import (
    FINISH_REASONS, ChatRequest, CompletionRequest, chat_messages, completion_prompt,
    generate_options, parse, usage,
)
from gateway.schemas import ChatCompletion, ChatCompletionChunk, TextCompletion, responses

log = logging.getLogger("gateway")
_TEXT = "\x00specdec-text\x00"  # placeholder split out of the precomputed chunk JSON
_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}

HTTP_REQUESTS = Counter("specdec_http_requests_total",
                        "HTTP responses of the OpenAI-compatible gateway, by route and status",
                        ["route", "status"])
HTTP_SECONDS = Histogram("specdec_http_request_duration_seconds",
                         "HTTP request latency at the gateway, from the request to the response's "
                         "last byte (a stream: its whole length), by route", ["route"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
DISCONNECTS = Counter("specdec_http_stream_disconnects_total",
                      "Streams the HTTP client left before the end (generation cancelled)")


class _CountResponses:
    """Pure ASGI middleware: count each response's status and time it to its last byte."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = (path if path in _ROUTES else "/v1/models" if path.startswith("/v1/models/")
                 else "/playground" if path.startswith("/playground") else "other")
        start = time.perf_counter()

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                HTTP_REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                HTTP_SECONDS.labels(route).observe(time.perf_counter() - start)

        await self.app(scope, receive, counted)


@dataclass(frozen=True)
class Settings:
    orchestrator: str = "127.0.0.1:50050"
    model_name: str = "specdec"          # the id /v1/models lists and requests must name
    default_max_tokens: int = 256        # when a request gives neither max_tokens form
    timeout_s: float = 600.0             # deadline of one Generate call
    grace_s: float = 10.0                # streams get this long to finish on SIGTERM
    tls_ca: str | None = None            # CA of the orchestrator's certificate (TLS to it)
    tls_cert: str | None = None          # client certificate for mutual TLS
    tls_key: str | None = None
    playground: PlaygroundSettings | None = PlaygroundSettings()  # None: no /playground
    max_body_bytes: int = 4 << 20        # a larger request body is a 413, refused as it is read
    allowed_hosts: frozenset[str] | None = frozenset(LOCAL_HOSTS)  # None: any (see gateway.guard)


def create_app(settings: Settings) -> FastAPI:
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tls = dict(ca=settings.tls_ca, cert=settings.tls_cert, key=settings.tls_key)
        app.state.client = AsyncClient(settings.orchestrator, timeout=settings.timeout_s, **tls)
        app.state.health = aio_channel(settings.orchestrator, channel_credentials(**tls))
        yield
        await app.state.client.close()
        await app.state.health.close()

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.credentials = Credentials()
    # Starlette runs the middleware added last first: the count, then Host/Origin, then the size.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(HostCheck, allowed=settings.allowed_hosts, credentials=app.state.credentials,
                       channel=lambda: app.state.health)
    app.add_middleware(_CountResponses)

    if settings.playground is not None:
        playground.install(app, settings.playground)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()

    @app.get("/health")
    async def health() -> dict:
        """200 while the orchestrator reports SERVING, else 503 (readiness)."""
        stub = health_pb2_grpc.HealthStub(app.state.health)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            status = f"{exc.code().name}: {exc.details()}"
        if status != "SERVING":
            raise APIError(503, f"orchestrator {settings.orchestrator}: {status}",
                           code="orchestrator_unavailable")
        return {"status": "ok", "orchestrator": settings.orchestrator}

    def _model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": created,
                "owned_by": "specdec"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict:
        if model_id != settings.model_name:
            raise _no_such_model(model_id)
        return _model_card()

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatRequest),
              responses=responses(ChatCompletion, ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat=True)

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest),
              responses=responses(TextCompletion, TextCompletion))
    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    def openapi() -> dict:
        """FastAPI's document plus the request bodies (parsed by gateway.protocol, not by
        FastAPI, so that every error is the OpenAI shape) and the stream's chunk events."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model, mode in ((ChatRequest, "validation"), (CompletionRequest, "validation"),
                                (ChatCompletionChunk, "serialization")):
                schema = model.model_json_schema(mode=mode, ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

    async def _generate(request: Request, *, chat: bool) -> Response:
        req = parse(ChatRequest if chat else CompletionRequest, await _body(request))
        options = generate_options(req, settings.default_max_tokens)
        if chat:
            options["messages"] = chat_messages(req)
        else:
            options["prompt"] = completion_prompt(req)
        if req.model != settings.model_name:
            raise _no_such_model(req.model)
        prompt_param = "messages" if chat else "prompt"
        auth = request.headers.get("authorization")
        metadata = (("authorization", auth),) if auth else None
        stream = app.state.client.generate(metadata=metadata, **options)
        first, events = await first_chunk(stream, prompt_param)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        n = options["n"]
        if not req.stream:
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
            return JSONResponse(_whole(ident, chat, ["".join(t) for t in texts],
                                       _choice_stats(stream, n), entries))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _sse(ident, chat, n, first, events, stream, include_usage, prompt_param)
        return EventSourceResponse(body, sep="\n", ping=15,
                                   shutdown_grace_period=settings.grace_s)

    def _whole(ident: str, chat: bool, texts: list[str], stats: list, entries: list[list]) -> dict:
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
                "created": int(time.time()), "model": settings.model_name,
                "system_fingerprint": None, "choices": choices, "usage": usage(stats)}

    async def _sse(ident: str, chat: bool, n: int, first, events: AsyncIterator, stream,
                   include_usage: bool, prompt_param: str) -> AsyncIterator[str]:
        """`data:` lines of one streamed generation, ending with `[DONE]`. With n > 1 the
        choices' chunks interleave, each with its `index`; a choice's finish chunk goes out
        as soon as its Stats has come."""
        now = int(time.time())
        base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": now, "model": settings.model_name, "system_fingerprint": None}
        if include_usage:
            base["usage"] = None

        def chunk(index: int, delta_or_text, finish=None, lps=None) -> str:
            if chat:
                choice = {"index": index, "delta": delta_or_text, "logprobs": lps,
                          "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta_or_text, "logprobs": lps,
                          "finish_reason": finish}
            return json.dumps({**base, "choices": [choice]})

        # Text chunks are the precomputed JSON with the text spliced in.
        spliced = [chunk(i, {"content": _TEXT} if chat else _TEXT).split(json.dumps(_TEXT))
                   for i in range(n)]
        ended: set[int] = set()

        def finished_choices() -> list[str]:
            out = []
            for index in sorted(set(stream.choice_stats) - ended):
                ended.add(index)
                st = stream.choice_stats[index]
                out.append(chunk(index, {} if chat else "",
                                 FINISH_REASONS.get(st.finish_reason, st.finish_reason)))
            return out

        offsets = [0] * n  # completions' text_offset: characters streamed so far per choice

        def text(piece) -> str:
            if piece.logprobs:  # built whole: the log-probabilities ride along
                if chat:
                    line = chunk(piece.index, {"content": piece.text}, lps=logprobs.chat(piece.logprobs))
                else:
                    line = chunk(piece.index, piece.text,
                                 lps=logprobs.completion(piece.logprobs, offsets[piece.index]))
                offsets[piece.index] += len(piece.text)
                return line
            head, tail = spliced[piece.index]
            return head + json.dumps(piece.text) + tail

        finished = False
        try:
            if chat:
                for index in range(n):
                    yield chunk(index, {"role": "assistant", "content": ""})
            if first is not None and (first.text or first.logprobs):
                yield text(first)
            async for piece in events:
                for line in finished_choices():
                    yield line
                if piece.text or piece.logprobs:  # an EOS has no text, but its log-probability
                    yield text(piece)
            for line in finished_choices():
                yield line
            if include_usage:
                yield json.dumps({**base, "choices": [], "usage": usage(_choice_stats(stream, n))})
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

    return app


_REF = "#/components/schemas/{model}"


def _request_body(model: type) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


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


def _no_such_model(name: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist (this server serves the model "
                         "listed by /v1/models)", param="model", code="model_not_found")

"""The ASGI app: OpenAI-compatible endpoints in front of one orchestrator address.

Every generation is one `Orchestrator.Generate` stream through `client.AsyncClient`;
no model work happens here. The routes are in gateway/routes/; what they share (the
settings, the orchestrator's client and channel, the playground's quota and cache) is one
gateway.state.Gateway on `app.state.gateway`.

Before any route (gateway.guard): a body over --max-body-bytes is a 413 while it is read,
and, while the orchestrator takes calls without a token, only --allowed-hosts names may be
in Host and Origin. /metrics is on its own port (--metrics-port), never on the API's.
"""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from prometheus_client import Counter, Histogram
from starlette.exceptions import HTTPException
from starlette.responses import Response

from gateway.errors import APIError
from gateway.guard import BodyLimit, HostCheck, TokenCheck
from gateway.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from gateway.responses.translate import ResponsesRequest
from gateway.routes import completions, health, models, playground, responses, tokenize
from gateway.schemas import REF, ChatCompletionChunk, ResponseEvent
from gateway.state import Gateway, Settings

__all__ = ["Settings", "create_app"]

_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/tokenize",
           "/detokenize", "/health", "/health/live"}

HTTP_REQUESTS = Counter("specdec_http_requests_total",
                        "HTTP responses of the OpenAI-compatible gateway, by route and status",
                        ["route", "status"])
HTTP_SECONDS = Histogram("specdec_http_request_duration_seconds",
                         "HTTP request latency at the gateway, from the request to the response's "
                         "last byte (a stream: its whole length), by route", ["route"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=_lifespan,
                  docs_url=None, redoc_url=None)
    gateway = app.state.gateway = Gateway(settings)
    # Starlette runs the middleware added last first: the count, the token, Host/Origin, the size.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(HostCheck, allowed=settings.allowed_hosts, credentials=gateway.credentials,
                       channel=lambda: gateway.channel)
    app.add_middleware(TokenCheck, credentials=gateway.credentials, verdicts=gateway.verdicts,
                       channel=lambda: gateway.channel)
    app.add_middleware(_CountResponses)
    if settings.playground is not None:
        playground.install(app)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    for router in (health.router, models.router, completions.router, responses.router, tokenize.router):
        app.include_router(router)
    app.openapi = lambda: _openapi(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.gateway.open()
    yield
    await app.state.gateway.close()


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document plus the request bodies (parsed by gateway.protocol, not by
    FastAPI, so that every error is the OpenAI shape) and the stream's chunk events."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model, mode in ((ChatRequest, "validation"), (CompletionRequest, "validation"),
                            (ResponsesRequest, "validation"), (TokenizeRequest, "validation"),
                            (DetokenizeRequest, "validation"), (ChatCompletionChunk, "serialization"),
                            (ResponseEvent, "serialization")):
            schema = model.model_json_schema(mode=mode, ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = doc
    return app.openapi_schema


class _CountResponses:
    """Pure ASGI middleware: count each response's status and time it to its last byte."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = (path if path in _ROUTES else "/v1/models" if path.startswith("/v1/models/")
                 else "/v1/responses" if path.startswith("/v1/responses/")
                 else "/playground" if path.startswith("/playground") else "other")
        start = time.perf_counter()

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                HTTP_REQUESTS.labels(route, str(message["status"])).inc()
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                HTTP_SECONDS.labels(route).observe(time.perf_counter() - start)

        await self.app(scope, receive, counted)

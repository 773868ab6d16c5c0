"""/playground: the page and the small HTTP API behind it (its pieces: gateway.playground).

    GET  /playground                 the page
    GET  /playground/api/info        the visitor's pass quota
    POST /playground/api/predict     {text, top_k}: every position's predictions, one pass
    POST /playground/api/check       {prompt, guess}: Check, one pass
    POST /playground/api/generate    {prompt, proposer, k, max_new_tokens, temperature,
                                      seed, guess}: SSE events `round` ... `done` (or `error`)
    POST /playground/api/sample      {prompt, draws, seed, sampler, temperature}: first tokens
                                      through rejection sampling against p, chi-square
    GET  /playground/api/speedup     ?alpha&k&c&v: specdec.core.speedup's curves

The caller's `Authorization` header goes with every call to the orchestrator, as on the
API routes. /api/info says whether the orchestrator requires one (`credentials`:
"required", "none" or "unknown"); the page then asks for a token and, without one, says
so instead of running anything.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import grpc
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from client.api import predict_request
from gateway import state
from gateway.errors import APIError, first_chunk, from_rpc_error, invalid
from gateway.playground import (
    MAX_DRAWS, MAX_NEW_TOKENS, PREFIX, STATIC, CheckBody, GenerateBody, PredictBody, Run,
    RunCache, SampleBody, check_result, draw, parse_body, predict_result, replay,
    speedup_table,
)
from gateway.playground.quota import QuotaExhausted
from orchestrator.proposers.registry import kinds
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

router = APIRouter(prefix=PREFIX)


def install(app: FastAPI) -> None:
    """Serve the page, its assets and its API on `app` (whose Gateway holds a Playground)."""
    app.include_router(router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC), name="playground-static")
    app.add_exception_handler(QuotaExhausted, _quota_error)


@router.get("", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def page() -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html",
                        headers={"Cache-Control": "no-cache"})


@router.get("/api/info")
async def info(request: Request) -> dict:
    gw = state.of(request)
    required = await gw.credentials.check(gw.channel)
    served = await gw.served.learn(gw.channel, _credentials(request))
    return {"quota": gw.playground.quota_status(request), "max_new_tokens": MAX_NEW_TOKENS,
            "max_draws": MAX_DRAWS, "proposers": proposer_choices(served),
            "credentials": {True: "required", False: "none", None: "unknown"}[required]}


def proposer_choices(served) -> list[dict]:
    """Step 4's proposers: what the orchestrator serves (ServedModel.proposers) but target-only,
    each with the registry's summary where this gateway knows the kind."""
    known = kinds(plugins=False)
    names = list(served.proposers) if served is not None and served.proposers else list(known)
    return [{"name": name, "summary": known[name].summary if name in known else name}
            for name in names if name != "none" and (name not in known or known[name].requestable)]


@router.post("/api/predict")
async def predict(request: Request) -> dict:
    body = parse_body(PredictBody, await _json(request))

    async def call() -> dict:
        reply = await _orchestrator(request).Predict(predict_request(body.text, body.top_k),
                                                     **_call_options(request))
        return predict_result(reply)

    return await _one_pass(request, "predict", body, call)


@router.post("/api/check")
async def check(request: Request) -> dict:
    body = parse_body(CheckBody, await _json(request))

    async def call() -> dict:
        reply = await _orchestrator(request).Check(
            pb.CheckRequest(prompt=body.prompt, guess=body.guess), **_call_options(request))
        return check_result(reply)

    return await _one_pass(request, "check", body, call)


@router.post("/api/sample")
async def sample(request: Request) -> dict:
    body = parse_body(SampleBody, await _json(request))
    pg = state.of(request).playground
    # The distributions are the only target work: a new sampler, seed or number of
    # draws over a prompt already seen costs nothing.
    dist_key = f"dist:{_credential_digest(request)}:" + json.dumps(
        [body.prompt, body.temperature, body.top_k])
    dist = pg.cache.get(dist_key)
    charged = 0
    if dist is None:
        reservation = pg.quota.reserve(pg.visitor(request), 1)
        try:
            dist = await _orchestrator(request).Predict(
                predict_request(body.prompt, 20, body.temperature, True, body.top_k),
                **_call_options(request))
        except grpc.RpcError as exc:
            reservation.settle(0)
            raise from_rpc_error(exc, "prompt") from None
        reservation.settle(1)
        charged = 1
        pg.cache.put(dist_key, dist)
    result = await asyncio.get_running_loop().run_in_executor(None, draw, dist, body)
    return {**result, **pg.meta(request, passes=1, charged=charged, cached=not charged)}


@router.get("/api/speedup")
async def speedup_curves(alpha: float = 0.6, k: int = 4, c: float = 0.1,
                         v: float = 1.0) -> dict:
    return speedup_table(alpha, k, c, v)


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    body = parse_body(GenerateBody, await _json(request))
    if body.proposer == "guess" and not body.guess:
        raise invalid("guess: required when proposer is guess", param="guess")
    gw = state.of(request)
    served = await gw.served.learn(gw.channel, _credentials(request))
    names = ["none", *(choice["name"] for choice in proposer_choices(served))]
    if body.proposer not in names:
        raise invalid(f"proposer: {body.proposer[:64]!r} is not one the orchestrator serves "
                      f"({', '.join(names)})", param="proposer")
    pg = gw.playground
    key = (RunCache.key("generate", body, _credential_digest(request))
           if _deterministic(body.temperature, body.seed) else None)
    recorded = pg.cache.get(key) if key else None
    if recorded is not None:
        return EventSourceResponse(replay(recorded, lambda: pg.quota_status(request)), sep="\n")
    reservation = pg.quota.reserve(pg.visitor(request), body.max_new_tokens)
    stream = gw.client.generate(
        body.prompt, max_new_tokens=body.max_new_tokens, temperature=body.temperature,
        seed=body.seed, proposer=body.proposer, k=body.k, guess=body.guess,
        round_tokens=True, max_target_passes=reservation.granted, metadata=_credentials(request))
    try:
        first, events = await first_chunk(stream, "prompt")
    except APIError:
        reservation.settle(0)  # refused before any pass
        raise
    except BaseException:
        reservation.settle(1)
        raise
    run = Run(first, events, stream, reservation, key, pg.cache,
              lambda: pg.quota_status(request), body.max_new_tokens)
    return EventSourceResponse(run.events(), sep="\n")


async def _quota_error(request: Request, exc: QuotaExhausted) -> Response:
    body = APIError(429, str(exc), code="pass_quota_exhausted").body()
    body["quota"] = state.of(request).playground.quota_status(request)
    return JSONResponse(body, status_code=429, headers={"Retry-After": str(exc.retry_after_s)})


async def _one_pass(request: Request, kind: str, body: BaseModel, call) -> dict:
    """A one-target-pass call (Predict, Check): from the cache, else charged 1 pass."""
    pg = state.of(request).playground
    key = RunCache.key(kind, body, _credential_digest(request))
    hit = pg.cache.get(key)
    if hit is not None:
        return {**hit, **pg.meta(request, passes=hit["passes"], charged=0, cached=True)}
    reservation = pg.quota.reserve(pg.visitor(request), 1)
    try:
        result = await call()
    except grpc.RpcError as exc:
        reservation.settle(0)
        raise from_rpc_error(exc, "prompt") from None
    except BaseException:
        reservation.settle(1)  # cut short while the pass may have run
        raise
    reservation.settle(result["passes"])
    pg.cache.put(key, result)
    return {**result, **pg.meta(request, passes=result["passes"], charged=result["passes"],
                                cached=False)}


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise invalid("the request body is not valid JSON", code="invalid_json") from None


def _credentials(request: Request) -> tuple[tuple[str, str], ...] | None:
    """The caller's Authorization header as the orchestrator call's metadata."""
    auth = request.headers.get("authorization")
    return (("authorization", auth),) if auth else None


def _credential_digest(request: Request) -> str:
    return hashlib.sha256((request.headers.get("authorization") or "").encode()).hexdigest()[:16]


def _call_options(request: Request) -> dict:
    """One orchestrator call's deadline and the caller's credentials."""
    return {"timeout": state.of(request).client.timeout, "metadata": _credentials(request)}


def _orchestrator(request: Request) -> orchestrator_pb2_grpc.OrchestratorStub:
    # Check and Predict straight on the gateway's channel: AsyncClient's take no metadata.
    return orchestrator_pb2_grpc.OrchestratorStub(state.of(request).channel)


def _deterministic(temperature: float, seed: int) -> bool:
    """Greedy, or sampled with a seed: the same request gives the same tokens."""
    return temperature == 0 or seed > 0

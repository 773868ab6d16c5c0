"""The playground: a page at /playground and the small HTTP API behind it.

The page (gateway/static/: hand-written HTML, CSS and JavaScript, no external asset) walks
through the station in five steps: one token per pass, all at once (Predict), you guess
(Check), copy and check (a generation's rounds, each drafted / accepted / recovered / bonus
token and its source), and the real thing (the speed-up model against the session's
measured alpha, c, v; the sampling panel). Everything it shows comes from the orchestrator
through these endpoints:

    GET  /playground                 the page
    GET  /playground/api/info        the visitor's pass quota
    POST /playground/api/predict     {text, top_k}: every position's predictions, one pass
    POST /playground/api/check       {prompt, guess}: Check, one pass
    POST /playground/api/generate    {prompt, proposer, k, max_new_tokens, temperature,
                                      seed, guess}: SSE events `round` ... `done` (or `error`)
    POST /playground/api/sample      {prompt, draws, seed, sampler, temperature}: first tokens
                                      through rejection sampling against p, chi-square
    GET  /playground/api/speedup     ?alpha&k&c&v: specdec.core.speedup's curves

Every endpoint that runs the target charges the visitor's pass quota (gateway.quota) in
target passes; a visitor is the caller's address, or behind --trusted-proxies the address
they forwarded (gateway.guard.client_address). A run whose result is a function of its
request (greedy, or sampling with a seed) is kept in a small LRU cache; repeating it with
the same credentials replays the recorded result and costs nothing.

The caller's `Authorization` header goes with every call to the orchestrator, as on the
API routes. /api/info says whether the orchestrator requires one (`credentials`:
"required", "none" or "unknown"); the page then asks for a token and, without one, says
so instead of running anything.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from client.api import predict_request
from gateway.errors import APIError, first_chunk, from_rpc_error, invalid
from gateway.guard import Network, client_address
from gateway.quota import PassQuota, QuotaExhausted
from specdec.core import speedup
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

log = logging.getLogger("gateway.playground")
STATIC = Path(__file__).resolve().parent / "static"
PREFIX = "/playground"
MAX_NEW_TOKENS = 64  # per playground generation
MAX_DRAWS = 20_000


@dataclass(frozen=True)
class PlaygroundSettings:
    passes_per_minute: int = 30  # target passes per visitor per minute; 0 = no quota
    cache_entries: int = 256  # runs kept for free replays
    trusted_proxies: tuple[Network, ...] = ()  # whose X-Forwarded-For names the visitor


# ------------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PredictBody(_Body):
    text: str = Field(min_length=1, max_length=4000)
    top_k: int = Field(5, ge=1, le=20)


class CheckBody(_Body):
    prompt: str = Field(min_length=1, max_length=4000)
    guess: str = Field(min_length=1, max_length=2000)


class GenerateBody(_Body):
    prompt: str = Field(min_length=1, max_length=4000)
    proposer: Literal["none", "draft", "lookup", "guess", "combined"] = "none"
    k: int = Field(0, ge=0, le=16)
    max_new_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    seed: int = Field(0, ge=0, lt=2**63)
    guess: str = Field("", max_length=2000)


class SampleBody(_Body):
    prompt: str = Field(min_length=1, max_length=4000)
    draws: int = Field(2000, ge=10, le=MAX_DRAWS)
    seed: int = Field(1, ge=1, lt=2**63)
    sampler: Literal["exact", "wrong"] = "exact"
    temperature: float = Field(1.0, ge=0.05, le=5.0)
    top_k: int = Field(40, ge=1, le=1000)  # the sampler's truncation of p and q


def _parse(model: type[_Body], body: Any) -> _Body:
    """Validate a JSON body; a failure is a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise invalid(f"{loc}: {err['msg']}", param=str(err["loc"][0]) if err["loc"] else None)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise invalid("the request body is not valid JSON", code="invalid_json") from None


# ------------------------------------------------------------------- the cache of runs


class RunCache:
    """Results of deterministic runs by request (LRU): a repeat replays them for free."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._runs: OrderedDict[str, Any] = OrderedDict()

    @staticmethod
    def key(kind: str, body: _Body, credentials: str = "") -> str:
        """The run's key: what it asked, and with which credentials (`_credential_digest`: a run
        made with a token is replayed only to callers with the same token)."""
        return f"{kind}:{credentials}:" + json.dumps(body.model_dump(), sort_keys=True)

    def get(self, key: str) -> Any | None:
        if key in self._runs:
            self._runs.move_to_end(key)
            return self._runs[key]
        return None

    def put(self, key: str, value: Any) -> None:
        if self.entries <= 0:
            return
        self._runs[key] = value
        self._runs.move_to_end(key)
        while len(self._runs) > self.entries:
            self._runs.popitem(last=False)


def _credentials(request: Request) -> tuple[tuple[str, str], ...] | None:
    """The caller's Authorization header as the orchestrator call's metadata."""
    auth = request.headers.get("authorization")
    return (("authorization", auth),) if auth else None


def _credential_digest(request: Request) -> str:
    return hashlib.sha256((request.headers.get("authorization") or "").encode()).hexdigest()[:16]


def _call_options(request: Request) -> dict:
    """One orchestrator call's deadline and the caller's credentials."""
    return {"timeout": request.app.state.client.timeout, "metadata": _credentials(request)}


def _orchestrator(request: Request) -> orchestrator_pb2_grpc.OrchestratorStub:
    # Check and Predict straight on the gateway's channel: AsyncClient's take no metadata.
    return orchestrator_pb2_grpc.OrchestratorStub(request.app.state.health)


def _deterministic(temperature: float, seed: int) -> bool:
    """Greedy, or sampled with a seed: the same request gives the same tokens."""
    return temperature == 0 or seed > 0


# ------------------------------------------------------------------- the page and its API


def install(app: FastAPI, settings: PlaygroundSettings) -> None:
    """Serve the page and its API on `app` (which holds an AsyncClient in app.state.client)."""
    quota = PassQuota(settings.passes_per_minute)
    cache = RunCache(settings.cache_entries)
    router = APIRouter(prefix=PREFIX)

    def visitor(request: Request) -> str:
        return client_address(request.client.host if request.client else None,
                              request.headers.get("x-forwarded-for"), settings.trusted_proxies)

    def meta(request: Request, *, passes: int, charged: int, cached: bool) -> dict:
        return {"passes": passes, "charged": charged, "cached": cached,
                "quota": quota.status(visitor(request))}

    async def one_pass(request: Request, kind: str, body: _Body, call) -> dict:
        """A one-target-pass call (Predict, Check): from the cache, else charged 1 pass."""
        key = RunCache.key(kind, body, _credential_digest(request))
        hit = cache.get(key)
        if hit is not None:
            return {**hit, **meta(request, passes=hit["passes"], charged=0, cached=True)}
        reservation = quota.reserve(visitor(request), 1)
        try:
            result = await call()
        except grpc.RpcError as exc:
            reservation.settle(0)
            raise from_rpc_error(exc, "prompt") from None
        except BaseException:
            reservation.settle(1)  # cut short while the pass may have run
            raise
        reservation.settle(result["passes"])
        cache.put(key, result)
        return {**result, **meta(request, passes=result["passes"], charged=result["passes"],
                                 cached=False)}

    @router.get("", include_in_schema=False)
    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @router.get("/api/info")
    async def info(request: Request) -> dict:
        required = await request.app.state.credentials.check(request.app.state.health)
        return {"quota": quota.status(visitor(request)), "max_new_tokens": MAX_NEW_TOKENS,
                "max_draws": MAX_DRAWS,
                "credentials": {True: "required", False: "none", None: "unknown"}[required]}

    @router.post("/api/predict")
    async def predict(request: Request) -> dict:
        body = _parse(PredictBody, await _json(request))

        async def call() -> dict:
            reply = await _orchestrator(request).Predict(predict_request(body.text, body.top_k),
                                                         **_call_options(request))
            return {"tokens": [_token(t) for t in reply.tokens],
                    "next": [_candidate(c) for c in reply.next], "passes": reply.target_passes}

        return await one_pass(request, "predict", body, call)

    @router.post("/api/check")
    async def check(request: Request) -> dict:
        body = _parse(CheckBody, await _json(request))

        async def call() -> dict:
            reply = await _orchestrator(request).Check(
                pb.CheckRequest(prompt=body.prompt, guess=body.guess), **_call_options(request))
            return _check_result(reply)

        return await one_pass(request, "check", body, call)

    @router.post("/api/sample")
    async def sample(request: Request) -> dict:
        body = _parse(SampleBody, await _json(request))
        # The distributions are the only target work: a new sampler, seed or number of
        # draws over a prompt already seen costs nothing.
        dist_key = f"dist:{_credential_digest(request)}:" + json.dumps(
            [body.prompt, body.temperature, body.top_k])
        dist = cache.get(dist_key)
        charged = 0
        if dist is None:
            reservation = quota.reserve(visitor(request), 1)
            try:
                dist = await _orchestrator(request).Predict(
                    predict_request(body.prompt, 20, body.temperature, True, body.top_k),
                    **_call_options(request))
            except grpc.RpcError as exc:
                reservation.settle(0)
                raise from_rpc_error(exc, "prompt") from None
            reservation.settle(1)
            charged = 1
            cache.put(dist_key, dist)
        result = await asyncio.get_running_loop().run_in_executor(None, _draw, dist, body)
        return {**result, **meta(request, passes=1, charged=charged, cached=not charged)}

    @router.get("/api/speedup")
    async def speedup_curves(alpha: float = 0.6, k: int = 4, c: float = 0.1,
                             v: float = 1.0) -> dict:
        return speedup_table(alpha, k, c, v)

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = _parse(GenerateBody, await _json(request))
        if body.proposer == "guess" and not body.guess:
            raise invalid("guess: required when proposer is guess", param="guess")
        key = (RunCache.key("generate", body, _credential_digest(request))
               if _deterministic(body.temperature, body.seed) else None)
        recorded = cache.get(key) if key else None
        if recorded is not None:
            return EventSourceResponse(_replay(recorded, lambda: quota.status(visitor(request))),
                                       sep="\n")
        reservation = quota.reserve(visitor(request), body.max_new_tokens)
        stream = request.app.state.client.generate(
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
        run = _Run(first, events, stream, reservation, key, cache,
                   lambda: quota.status(visitor(request)), body.max_new_tokens)
        return EventSourceResponse(run.events(), sep="\n")

    app.include_router(router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC), name="playground-static")

    @app.exception_handler(QuotaExhausted)
    async def _quota_error(request: Request, exc: QuotaExhausted) -> Response:
        body = APIError(429, str(exc), code="pass_quota_exhausted").body()
        body["quota"] = quota.status(visitor(request))
        return JSONResponse(body, status_code=429, headers={"Retry-After": str(exc.retry_after_s)})


# ------------------------------------------------------------------- generation events


class _Run:
    """One live generation as SSE events; books its passes and records it for replays."""

    def __init__(self, first, events: AsyncIterator, stream, reservation, key: str | None,
                 cache: RunCache, quota_status, max_new_tokens: int) -> None:
        self.first, self.rest, self.stream = first, events, stream
        self.reservation, self.key, self.cache = reservation, key, cache
        self.quota_status, self.max_new_tokens = quota_status, max_new_tokens
        self.passes = 0

    async def _chunks(self) -> AsyncIterator:
        if self.first is not None:
            yield self.first
        async for chunk in self.rest:
            yield chunk

    async def events(self) -> AsyncIterator[dict]:
        recorded: list[dict] = []
        tokens = 0
        try:
            async for chunk in self._chunks():
                tokens += len(chunk.token_ids)
                event = _round_event(chunk, tokens)
                self.passes = event["passes"]
                recorded.append(event)
                yield {"event": "round", "data": json.dumps(event)}
            stats = self.stream.stats
            self.reservation.settle(stats.target_passes)
            self.passes = -1  # settled
            done = _done_event(stats, recorded)
            cut = stats.finish_reason == "passes"
            if cut:
                done["quota_stop"] = (
                    f"Stopped after {stats.target_passes} target passes: the pass quota ran out "
                    f"({self.quota_status()['per_window']} per minute per visitor). Passes free "
                    "up as the minute goes by; a run you repeat comes from the cache and costs "
                    "nothing.")
            elif self.key is not None:
                self.cache.put(self.key, {"rounds": recorded, "done": done})
            yield {"event": "done", "data": json.dumps(
                {**done, "charged": stats.target_passes, "cached": False,
                 "quota": self.quota_status()})}
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, "prompt")
            yield {"event": "error", "data": json.dumps({**error.body(), "status": error.status})}
        finally:
            if self.passes >= 0:  # cut short (the visitor left, or an error): book what ran
                self.reservation.settle(self.passes)
            self.stream.cancel()


async def _replay(recorded: dict, quota_status) -> AsyncIterator[dict]:
    for event in recorded["rounds"]:
        yield {"event": "round", "data": json.dumps(event)}
    yield {"event": "done", "data": json.dumps(
        {**recorded["done"], "charged": 0, "cached": True, "quota": quota_status()})}


def _round_event(chunk, tokens: int) -> dict:
    r = chunk.round
    return {
        "round": r.round, "passes": r.round, "tokens": tokens, "source": r.source,
        "drafted": [{"id": i, "text": t} for i, t in zip(r.drafted_ids, r.drafted_texts)],
        "accepted": r.accepted, "extra_kind": r.extra_kind,
        "committed": [{"id": i, "text": t} for i, t in zip(chunk.token_ids, r.token_texts)],
        "text": chunk.text,
    }


def _done_event(stats, rounds: list[dict]) -> dict:
    return {
        "text": "".join(r["text"] for r in rounds),
        "token_ids": [t["id"] for r in rounds for t in r["committed"]],
        "finish_reason": stats.finish_reason,
        "stats": {
            "proposer": stats.proposer, "fallback_reason": stats.fallback_reason,
            "target_passes": stats.target_passes, "new_tokens": stats.new_tokens,
            "prompt_tokens": stats.prompt_tokens, "draft_calls": stats.draft_calls,
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": stats.acceptance_rate, "total_ms": stats.total_ms,
            "target_ms": stats.target_ms, "draft_ms": stats.draft_ms, "seed": stats.seed,
        },
    }


# ------------------------------------------------------------------- JSON forms


def _candidate(c) -> dict:
    return {"id": c.id, "text": c.text, "prob": c.prob}


def _token(t) -> dict:
    return {"id": t.id, "text": t.text, "prob": t.prob,
            "predicted": [_candidate(c) for c in t.predicted]}


def _check_result(reply) -> dict:
    positions = [{"position": p.position, "guess": {"id": p.guess_id, "text": p.guess_text,
                                                    "prob": p.guess_prob},
                  "predicted": {"id": p.predicted_id, "text": p.predicted_text,
                                "prob": p.predicted_prob}} for p in reply.positions]
    # What the round commits: the accepted guess, then the target's own token.
    extra = (positions[reply.first_mismatch]["predicted"] if reply.first_mismatch >= 0
             else {"id": reply.next_id, "text": reply.next_text, "prob": None})
    committed = [p["guess"] for p in positions[: reply.accepted]] + [extra]
    return {"accepted": reply.accepted, "first_mismatch": reply.first_mismatch,
            "positions": positions, "committed": committed,
            "extra_kind": "recovered" if reply.first_mismatch >= 0 else "bonus", "passes": 1}


def _draw(dist, body: SampleBody) -> dict:
    """The sampling panel's draws and test (CPU work: run off the event loop)."""
    from gateway import sampling_panel as panel
    from specdec.runtime.wire import decode_probs

    p = decode_probs(dist.target_next)[0]
    q = decode_probs(dist.draft_next)[0]
    tokens = panel.draw_first_tokens(p, q, body.draws, body.seed, body.sampler)
    bins = panel.bins_of(p, tokens, top=20)
    test = panel.chi_square(bins, body.draws)
    names = {c.id: c.text for c in dist.next}
    return {
        "draws": body.draws, "sampler": body.sampler, "seed": body.seed,
        "bins": [{"label": names.get(b.ids[0], f"#{b.ids[0]}") if len(b.ids) == 1
                  else f"other ({sum(bool(p[i] > 0) for i in b.ids)} tokens)", "other": len(b.ids) > 1,
                  "ids": list(b.ids[:1]),
                  "p": b.p, "count": b.count, "freq": b.count / body.draws} for b in bins],
        "chi_square": test.statistic, "dof": test.dof, "p_value": test.p_value,
        "target_only_passes": body.draws,
    }


def speedup_table(alpha: float, k: int, c: float, v: float) -> dict:
    """The speed-up model at (alpha, k, c, v), and its curves over k and over alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise invalid(f"alpha: must be in [0, 1], got {alpha}", param="alpha")
    if not 0 <= k <= 16:
        raise invalid(f"k: must be in 0..16, got {k}", param="k")
    if not 0.0 <= c <= 10.0:
        raise invalid(f"c: must be in [0, 10], got {c}", param="c")
    if not 0.0 < v <= 10.0:
        raise invalid(f"v: must be in (0, 10], got {v}", param="v")
    grid = [i / 50 for i in range(51)]
    return {
        "alpha": alpha, "k": k, "c": c, "v": v,
        "speedup": speedup.speedup(alpha, k, c, v),
        "tokens_per_pass": speedup.expected_tokens_per_pass(alpha, k),
        "best_k": speedup.best_k(alpha, c, v),
        "break_even_alpha": speedup.break_even_alpha(k, c, v),
        "over_k": [{"k": j, "speedup": speedup.speedup(alpha, j, c, v)} for j in range(17)],
        "over_alpha": [{"alpha": a, "speedup": speedup.speedup(a, k, c, v)} for a in grid],
    }

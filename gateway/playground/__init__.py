"""The playground's pieces: its settings and state, request bodies, the cache of runs, a
generation's SSE events and the sampling panel's draws (the routes: gateway.routes.playground).

The page (gateway/static/: hand-written HTML, CSS and JavaScript, no external asset) walks
through the station in five steps: one token per pass, all at once (Predict), you guess
(Check), copy and check (a generation's rounds, each drafted / accepted / recovered / bonus
token and its source), and the real thing (the speed-up model against the session's
measured alpha, c, v; the sampling panel). Everything it shows comes from the orchestrator.

Every endpoint that runs the target charges the visitor's pass quota (gateway.playground.quota) in
target passes; a visitor is the caller's address, or behind --trusted-proxies the address
they forwarded (gateway.guard.client_address). A run whose result is a function of its
request (greedy, or sampling with a seed) is kept in a small LRU cache; repeating it with
the same credentials replays the recorded result and costs nothing.
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from gateway.errors import from_rpc_error, invalid
from gateway.guard import Network, client_address
from gateway.playground.quota import PassQuota
from specdec.core import speedup
from specdec.core.bounds import MAX_K

log = logging.getLogger("gateway.playground")
STATIC = Path(__file__).resolve().parents[1] / "static"
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
    proposer: str = Field("none", min_length=1, max_length=64)  # a kind the orchestrator serves
    k: int = Field(0, ge=0, le=MAX_K)
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


def parse_body(model: type[_Body], body: Any) -> _Body:
    """Validate a JSON body; a failure is a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise invalid(f"{loc}: {err['msg']}", param=str(err["loc"][0]) if err["loc"] else None)


# ------------------------------------------------------------------- the cache of runs


class RunCache:
    """Results of deterministic runs by request (LRU): a repeat replays them for free."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._runs: OrderedDict[str, Any] = OrderedDict()

    @staticmethod
    def key(kind: str, body: _Body, credentials: str = "") -> str:
        """The run's key: what it asked, and with which credentials (a digest of the caller's
        Authorization header: a run made with a token is replayed only to callers with the same
        token)."""
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


# ------------------------------------------------------------------- one app's playground


class Playground:
    """One app's playground: its settings, the visitors' pass quota and the cache of runs."""

    def __init__(self, settings: PlaygroundSettings) -> None:
        self.settings = settings
        self.quota = PassQuota(settings.passes_per_minute)
        self.cache = RunCache(settings.cache_entries)

    def visitor(self, request: Request) -> str:
        return client_address(request.client.host if request.client else None,
                              request.headers.get("x-forwarded-for"), self.settings.trusted_proxies)

    def quota_status(self, request: Request) -> dict:
        return self.quota.status(self.visitor(request))

    def meta(self, request: Request, *, passes: int, charged: int, cached: bool) -> dict:
        return {"passes": passes, "charged": charged, "cached": cached,
                "quota": self.quota_status(request)}


# ------------------------------------------------------------------- generation events


class Run:
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


async def replay(recorded: dict, quota_status) -> AsyncIterator[dict]:
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


def predict_result(reply) -> dict:
    """A Predict reply's JSON: every position's token and predictions, and the next token's."""
    return {"tokens": [_token(t) for t in reply.tokens], "next": [_candidate(c) for c in reply.next],
            "passes": reply.target_passes}


def _candidate(c) -> dict:
    return {"id": c.id, "text": c.text, "prob": c.prob}


def _token(t) -> dict:
    return {"id": t.id, "text": t.text, "prob": t.prob,
            "predicted": [_candidate(c) for c in t.predicted]}


def check_result(reply) -> dict:
    """A Check reply's JSON, with what the round commits."""
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


def draw(dist, body: SampleBody) -> dict:
    """The sampling panel's draws and test (CPU work: run off the event loop)."""
    from gateway.playground import panel
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
    if not 0 <= k <= MAX_K:
        raise invalid(f"k: must be in 0..{MAX_K}, got {k}", param="k")
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

"""Bounded work per request: what a Generate request may ask the orchestrator to do.

`check` runs on the event loop before anything is counted or tokenised, cheapest
first (a count before the bytes it would take to sum), so a request with 100,000
stop strings is refused in microseconds. Each bound is INVALID_ARGUMENT naming
the field, the limit and its flag (specdec.runtime.limits.RequestLimits).

`prepare` does the request's one-time work off the event loop: the constraint's
grammar compiled on the grammars' threads within --grammar-compile-s
(orchestrator.common.grammar), the grammar tokenizer built for log-probabilities'
bytes, and a prediction's n-gram index (specdec.core.predicted_output), so the
loop only copies a matcher and looks n-grams up.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from orchestrator.common.kinds import PREDICTED_OUTPUT
from orchestrator.common.request import TurnRequest
from orchestrator.common.grammar import Grammars
from specdec.core.predicted_output import PredictionIndex
from specdec.runtime.errors import InvalidArgument
from specdec.runtime.limits import RequestLimits
from specdec.v1 import orchestrator_pb2 as pb


def constraint_bytes(request: Any) -> int:
    """UTF-8 bytes of a request's constraint text (a JSON schema, regex or Lark grammar)."""
    if not hasattr(request, "constraint") or not request.HasField("constraint"):
        return 0
    kind = request.constraint.WhichOneof("kind")
    value = getattr(request.constraint, kind) if kind else ""
    return len(value.encode()) if isinstance(value, str) else 0


def _over(field: str, size: int, unit: str, limit: int, flag: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {size} {unit}, above this server's limit of {limit} ({flag})")


def check(request: pb.GenerateRequest, limits: RequestLimits) -> None:
    """Every bound of a Generate request (see the module docstring)."""
    stops = len(request.stop)
    if limits.max_stop_strings and stops > limits.max_stop_strings:
        raise _over("stop", stops, "stop strings", limits.max_stop_strings, "--max-stop-strings")
    if limits.max_stop_bytes and stops:
        size = sum(len(s.encode()) for s in request.stop)
        if size > limits.max_stop_bytes:
            raise _over("stop", size, "bytes of stop strings", limits.max_stop_bytes, "--max-stop-bytes")
    if limits.max_prediction_bytes and len(request.prediction) > limits.max_prediction_bytes // 4:
        size = len(request.prediction.encode())  # only a prediction that might be over is encoded
        if size > limits.max_prediction_bytes:
            raise _over("prediction", size, "bytes", limits.max_prediction_bytes, "--max-prediction-bytes")
    size = constraint_bytes(request)
    if limits.max_grammar_bytes and size > limits.max_grammar_bytes:
        kind = request.constraint.WhichOneof("kind")
        raise _over(f"constraint.{kind}", size, "bytes", limits.max_grammar_bytes, "--max-grammar-bytes")
    if limits.max_top_logprobs and request.top_logprobs > limits.max_top_logprobs:
        raise InvalidArgument(f"top_logprobs: {request.top_logprobs} is above this server's limit of "
                              f"{limits.max_top_logprobs} (--max-top-logprobs)")


OffLoop = Callable[..., Awaitable[Any]]


async def prepare(req: TurnRequest, grammars: Grammars, limits: RequestLimits,
                  off_loop: OffLoop) -> TurnRequest:
    """The request with its grammar compiled and its prediction indexed (see the module docstring);
    `off_loop(fn, *args)` runs fn on the text threads."""
    changes: dict[str, Any] = {}
    if req.constraint is not None:
        changes["grammar"] = await grammars.compiled(req.constraint, limits.grammar_compile_s)
    elif req.logprobs:
        await off_loop(grammars.warm)  # once per process: the byte table (about 1 s)
    if req.proposer == PREDICTED_OUTPUT and req.guess_ids:
        changes["prediction"] = await off_loop(PredictionIndex, req.guess_ids)
    return dataclasses.replace(req, **changes) if changes else req

"""Check: one target pass over prompt + guess tells what the target predicts at every position.

Its throwaway session takes a target slot like a stream does (policy.capacity.TargetAdmission),
so Check and Predict are shed with the streams when every replica is full."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from orchestrator.fleet.routing import Router
from orchestrator.policy.capacity import TargetAdmission
from specdec.core.fingerprint import EMPTY
from specdec.core.sampling import SamplingParams
from specdec.core.verify import verify_greedy
from specdec.runtime.errors import InvalidArgument, Unavailable
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs, sampling_to_proto


@dataclass(frozen=True)
class Position:
    position: int  # index in the guess
    guess_id: int
    predicted_id: int  # the target's argmax here
    guess_prob: float  # target probability (temperature 1) of the guessed token
    predicted_prob: float


@dataclass(frozen=True)
class CheckResult:
    accepted: int  # guessed tokens accepted greedily (a prefix)
    first_mismatch: int  # -1 if the whole guess is accepted
    positions: list[Position]
    next_id: int  # the target's prediction after the whole guess


async def score_once(router: Router, tokens: list[int], k: int, sampling: SamplingParams,
                     tenant: str = "", admission: TargetAdmission | None = None,
                     wait_s: float = 10.0) -> model_pb2.ScoreResponse:
    """ONE target pass over `tokens` on a throwaway session: rows for the last k + 1 positions.
    With `admission` the session holds a target slot for the call (RESOURCE_EXHAUSTED when full)."""
    session_id = f"check-{uuid.uuid4().hex}"
    if admission is None:
        return await _score_on(await router.pick("target"), session_id, tokens, k, sampling, tenant)
    place = await admission.place(router, session_id, "", 0, wait_s=wait_s, tenant=tenant)
    try:
        return await _score_on(place.client if place else None, session_id, tokens, k, sampling, tenant)
    finally:
        if place is not None:
            admission.leave(place)


async def _score_on(target, session_id: str, tokens: list[int], k: int, sampling: SamplingParams,
                    tenant: str) -> model_pb2.ScoreResponse:
    if target is None:
        raise Unavailable("no target service replica is available")
    request = model_pb2.ScoreRequest(
        session_id=session_id,
        cache_position=0,
        prefix_hash=EMPTY,
        tokens=tokens,
        k=k,
        sampling=sampling_to_proto(sampling),
        output_mode=common_pb2.OUTPUT_MODE_PROBS,
        tenant=tenant,
    )
    try:
        response, _ = await target.score(request)
    finally:
        await target.release(session_id)
    return response


async def check(
    router: Router, prompt_ids: list[int], guess_ids: list[int], max_k: int, tenant: str = "",
    admission: TargetAdmission | None = None, wait_s: float = 10.0,
) -> CheckResult:
    """Score prompt + guess in ONE target pass, on a throwaway session."""
    if not guess_ids:
        raise InvalidArgument("guess: must not be empty")
    if len(guess_ids) > max_k:
        raise InvalidArgument(f"guess: {len(guess_ids)} tokens; at most {max_k} can be checked in one pass")
    # Temperature 1 without truncation: p is the model's own softmax.
    response = await score_once(router, prompt_ids + guess_ids, len(guess_ids),
                                SamplingParams(temperature=1.0), tenant, admission, wait_s)
    argmax = list(response.argmax_ids)  # [n + 1]
    probs = decode_probs(response.probs)  # [n + 1, vocab]
    verdict = verify_greedy(guess_ids, argmax)
    positions = [
        Position(i, g, argmax[i], float(probs[i, g]), float(probs[i, argmax[i]]))
        for i, g in enumerate(guess_ids)
    ]
    mismatch = -1 if verdict.all_accepted else verdict.accepted
    return CheckResult(verdict.accepted, mismatch, positions, argmax[-1])

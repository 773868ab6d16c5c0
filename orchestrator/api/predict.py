"""Predict ("all at once"): one target pass over a text gives the target's top predictions at
every position, and optionally the next-token distributions of the target (p) and the draft (q).

The forward is the same Score the loop sends (orchestrator.check.score_once, on a throwaway
session): a text of n tokens is scored as n - 1 "drafts", so one pass returns a row for each
of the last min(n, max_k + 1) positions. The draft's q comes from one Propose of k = 1 on its
own throwaway session; nothing about either session outlives the call.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from orchestrator.api.check import score_once
from orchestrator.fleet.routing import Router
from orchestrator.policy.capacity import TargetAdmission
from specdec.core.fingerprint import EMPTY
from specdec.core.sampling import SamplingParams
from specdec.runtime.errors import InvalidArgument, Unavailable
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs, encode_probs, sampling_to_proto

DEFAULT_TOP_K = 5
MAX_TOP_K = 20


@dataclass(frozen=True)
class Prediction:
    ids: list[int]  # the text's tokens
    scored_from: int  # index of the first token whose position was scored (row 0 predicts it)
    probs: torch.Tensor  # [n - scored_from + 1, vocab]: row i predicts token scored_from + i
    target_next: common_pb2.Distributions | None  # p after the whole text (as the target sent it)
    draft_next: common_pb2.Distributions | None  # q after the whole text


def predict_sampling(params: SamplingParams | None) -> SamplingParams:
    """Unset: the model's own softmax (temperature 1). Greedy rows say nothing: refused."""
    if params is None:
        return SamplingParams(temperature=1.0)
    if params.greedy:
        raise InvalidArgument("sampling.temperature: must be > 0 for Predict (the probabilities "
                              "of a greedy row are one-hot)")
    return params


def top_k_of(top_k: int) -> int:
    if top_k == 0:
        return DEFAULT_TOP_K
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidArgument(f"top_k: must be in 1..{MAX_TOP_K}, got {top_k}")
    return top_k


async def predict(router: Router, ids: list[int], sampling: SamplingParams, max_k: int,
                  *, distributions: bool = False, tenant: str = "",
                  admission: TargetAdmission | None = None, wait_s: float = 10.0) -> Prediction:
    """ONE target pass over `ids` (and one draft Propose with `distributions`); with `admission`
    it holds a target slot (orchestrator.api.check.score_once)."""
    if not ids:
        raise InvalidArgument("text: must not be empty")
    k = min(len(ids) - 1, max_k)
    response = await score_once(router, ids, k, sampling, tenant, admission, wait_s)
    draft_next = await _draft_next(router, ids, sampling, tenant) if distributions else None
    probs = decode_probs(response.probs)
    target_next = None
    if distributions:
        target_next = common_pb2.Distributions()
        target_next.CopyFrom(_last_row(response.probs, probs))
    return Prediction(ids, len(ids) - k, probs, target_next, draft_next)


def _last_row(wire: common_pb2.Distributions, probs: torch.Tensor) -> common_pb2.Distributions:
    """The last row of a [rows, vocab] matrix, in the wire form it came in (exact either way)."""
    return wire if int(wire.rows) == 1 else encode_probs(probs[-1:])


async def _draft_next(router: Router, ids: list[int], sampling: SamplingParams,
                      tenant: str = "") -> common_pb2.Distributions:
    draft = await router.pick("draft")
    if draft is None:
        raise Unavailable("distributions: no draft service replica is available")
    session_id = f"predict-{uuid.uuid4().hex}"
    request = model_pb2.ProposeRequest(
        session_id=session_id, cache_position=0, prefix_hash=EMPTY, tokens=ids, k=1,
        sampling=sampling_to_proto(sampling), output_mode=common_pb2.OUTPUT_MODE_PROBS, seed=1,
        tenant=tenant,
    )
    try:
        response, _ = await draft.propose(request)
    finally:
        await draft.release(session_id)
    if not response.tokens:  # at the context length: nothing drafted, no q
        raise InvalidArgument("text: no room after it in the draft's context for a next token")
    return response.probs


def top_candidates(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """(token id, probability) of the k most likely tokens of one row, most likely first."""
    values, indices = torch.topk(row, min(k, row.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(indices.tolist(), values.tolist())]

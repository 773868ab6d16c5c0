"""What both model servicers share: Release, GetInfo and the common request/response parts.

A role's servicer adds its one verb (target_service: Score, draft_service:
Propose) and stays thin: decode -> the role's function on the worker -> encode.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from specdec.hosting.host import ModelHost, SessionWork
from specdec.hosting.requests import ModelRequest, decode_request, require_session_id
from specdec.v1 import common_pb2
from specdec.wire import encode_probs


class ModelServicerBase:
    """Release and GetInfo, identical for both roles; `role` names the subclass's role."""

    role = ""

    def __init__(self, host: ModelHost):
        self.host = host

    def decode(self, request: Any) -> ModelRequest:
        return decode_request(request, self.host.loaded, self.host.limits)

    async def Release(self, request: common_pb2.ReleaseRequest, context: Any) -> common_pb2.ReleaseResponse:
        timed = await self.host.run(self.host.release, require_session_id(request.session_id))
        return common_pb2.ReleaseResponse(released=timed.value)

    async def GetInfo(self, request: common_pb2.GetInfoRequest, context: Any) -> common_pb2.ModelInfo:
        m = self.host.loaded
        return common_pb2.ModelInfo(
            model_name=m.name,
            role=self.role,
            vocab_size=m.vocab_size,
            tokenizer_fingerprint=m.tokenizer_fingerprint,
            eos_token_ids=list(m.eos_token_ids),
            context_length=m.context_length,
            device=str(m.device),
            dtype=str(m.dtype).removeprefix("torch."),
            parameter_count=m.parameter_count,
            max_k=self.host.limits.max_k,
            replica_id=self.host.replica_id,
            max_request_tokens=self.host.limits.max_request_tokens,
            max_batch=self.host.max_batch,
        )


def fill_response(response: Any, work: SessionWork, started: float, probs: torch.Tensor | None) -> Any:
    """Set a Score/Propose response's cache_length, timing and (PROBS mode) probs; return it."""
    response.cache_length = work.cache_length
    response.timing.CopyFrom(common_pb2.ServerTiming(
        queue_ms=work.queue_ms, forward_ms=work.forward_ms,
        total_ms=(time.perf_counter() - started) * 1e3,
        batch_rows=work.batch_rows, batch_tokens=work.batch_tokens, forwards=work.forwards,
    ))
    if probs is not None:
        response.probs.CopyFrom(encode_probs(probs))
    return response

"""TargetService: decode -> ModelHost.score -> encode."""
from __future__ import annotations

import time
from typing import Any

from specdec.errors import InvalidArgument
from specdec.hosting.service import ModelServicerBase, timing
from specdec.v1 import model_pb2, model_pb2_grpc
from specdec.wire import encode_probs

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
DEFAULT_PORT = 50061


class TargetServicer(ModelServicerBase, model_pb2_grpc.TargetServiceServicer):
    role = "target"

    async def Score(self, request: model_pb2.ScoreRequest, context: Any) -> model_pb2.ScoreResponse:
        started = time.perf_counter()
        host = self.host
        k = request.k
        tokens, sampling, want_probs = self.decode(request, "k", k)
        if k > len(tokens) - 1:
            # The first drafted token is scored by the logits of the token before
            # it, which must be in this request.
            raise InvalidArgument(f"k {k} must be at most len(tokens) - 1 = {len(tokens) - 1}")
        timed = await host.run(
            host.score, request.session_id, request.cache_position, request.prefix_hash,
            tokens, k, sampling, want_probs,
        )
        result = timed.value
        response = model_pb2.ScoreResponse(
            argmax_ids=result.argmax_ids,
            cache_length=result.cache_length,
            timing=timing(timed.queue_ms, result.forward_ms, started),
        )
        if result.probs is not None:
            response.probs.CopyFrom(encode_probs(result.probs))
        return response

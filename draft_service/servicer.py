"""DraftService: decode -> ModelHost.propose -> encode."""
from __future__ import annotations

import math
import time
from typing import Any

from specdec.errors import InvalidArgument
from specdec.hosting.service import ModelServicerBase, timing
from specdec.v1 import model_pb2, model_pb2_grpc
from specdec.wire import encode_probs

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
DEFAULT_PORT = 50062


class DraftServicer(ModelServicerBase, model_pb2_grpc.DraftServiceServicer):
    role = "draft"

    async def Propose(self, request: model_pb2.ProposeRequest, context: Any) -> model_pb2.ProposeResponse:
        started = time.perf_counter()
        host = self.host
        tokens, sampling, want_probs = self.decode(request, "k", request.k)
        p_min = request.p_min
        if not (math.isfinite(p_min) and 0.0 <= p_min <= 1.0):
            raise InvalidArgument(f"p_min must be in [0, 1], got {p_min}")
        timed = await host.run(
            host.propose, request.session_id, request.cache_position, request.prefix_hash,
            tokens, request.k, sampling, want_probs, request.seed, p_min,
        )
        result = timed.value
        response = model_pb2.ProposeResponse(
            tokens=result.tokens,
            cache_length=result.cache_length,
            timing=timing(timed.queue_ms, result.forward_ms, started),
        )
        if result.probs is not None:
            response.probs.CopyFrom(encode_probs(result.probs))
        return response

"""TargetService: decode -> target_service.scoring.score on the batching worker -> encode."""
from __future__ import annotations

import time
from typing import Any

from specdec.hosting.servicer import ModelServicerBase, fill_response
from specdec.v1 import model_pb2, model_pb2_grpc
from target_service.scoring import check_score, score


class TargetServicer(ModelServicerBase, model_pb2_grpc.TargetServiceServicer):
    role = "target"

    async def Score(self, request: model_pb2.ScoreRequest, context: Any) -> model_pb2.ScoreResponse:
        started = time.perf_counter()
        req = self.decode(request)
        check_score(req)
        done = await score(self.host, req)
        scores = done.value
        return fill_response(model_pb2.ScoreResponse(argmax_ids=scores.argmax_ids), done, started,
                             scores.probs)

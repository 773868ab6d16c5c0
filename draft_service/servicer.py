"""DraftService: decode -> draft_service.drafting.propose on the batching worker -> encode."""
from __future__ import annotations

import time
from typing import Any

from draft_service.drafting import check_p_min, propose
from specdec.hosting.servicer import ModelServicerBase, fill_response
from specdec.v1 import model_pb2, model_pb2_grpc


class DraftServicer(ModelServicerBase, model_pb2_grpc.DraftServiceServicer):
    role = "draft"

    async def Propose(self, request: model_pb2.ProposeRequest, context: Any) -> model_pb2.ProposeResponse:
        started = time.perf_counter()
        req = self.decode(request)
        p_min = check_p_min(request.p_min)
        done = await propose(self.host, req, request.seed, p_min)
        drafts = done.value
        return fill_response(model_pb2.ProposeResponse(tokens=drafts.tokens), done, started, drafts.probs)

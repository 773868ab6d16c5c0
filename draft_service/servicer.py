"""DraftService: decode -> draft_service.drafting (a chain) or .trees (a token tree) on the scheduler
-> encode (Propose, ProposeBatch, ProposeStream). A feature head, and a model served through the stock forward, draft
chains only (their response names no parents)."""
from __future__ import annotations

from typing import Any

from draft_service.drafting import TOKENS_PREFILLED, ProposeWork, check_p_min
from draft_service.trees import TreeDrafts, TreeProposeWork
from engine.host import SessionWork
from specdec.runtime.errors import InvalidArgument
from model_service.servicer import FEATURE_KIND, ModelServicerBase, fill_response
from specdec.runtime.wire import decode_features
from specdec.v1 import model_pb2, model_pb2_grpc


class DraftServicer(ModelServicerBase, model_pb2_grpc.DraftServiceServicer):
    role = "draft"
    response_type = model_pb2.ProposeResponse

    def prepare(self, request: model_pb2.ProposeRequest) -> ProposeWork | TreeProposeWork:
        req = self.decode(request)
        features = None
        if request.HasField("features") and request.features.rows:
            dim = self.host.loaded.feature_dim
            if not dim:
                raise InvalidArgument("features: this draft reads token ids alone (ModelInfo.feature_dim = 0)")
            features = decode_features(request.features, dim)
            if features.shape[0] > len(req.tokens):
                raise InvalidArgument(f"features: {features.shape[0]} rows for {len(req.tokens)} tokens "
                                      "(at most one per token)")
        if req.tree_nodes and getattr(self.host.runner, "pooled", False):
            # A tree's nodes are candidates (no q): verified by the target's own tokens, or, with
            # OUTPUT_MODE_PROBS, by recursive rejection over siblings (verify_tree_sampled).
            return TreeProposeWork(self.host, req, features)
        return ProposeWork(self.host, req, request.seed, check_p_min(request.p_min), features)

    def features(self) -> tuple[int, str]:
        dim = self.host.loaded.feature_dim
        return dim, (self.host.loaded.feature_kind or FEATURE_KIND) if dim else ""

    def respond(self, request: model_pb2.ProposeRequest, done: SessionWork, started: float,
                response: model_pb2.ProposeResponse) -> model_pb2.ProposeResponse:
        drafts = done.value
        TOKENS_PREFILLED.inc(len(request.tokens))
        response.tokens.extend(drafts.tokens)
        if isinstance(drafts, TreeDrafts):
            response.parents.extend(drafts.parents)
            response.held.extend(drafts.held)
        return fill_response(response, done, started, drafts.probs)

    async def Propose(self, request: model_pb2.ProposeRequest, context: Any) -> model_pb2.ProposeResponse:
        return await self._single(request)

    async def ProposeBatch(self, request: model_pb2.ProposeBatchRequest,
                           context: Any) -> model_pb2.ProposeBatchResponse:
        return await self._batch(request, model_pb2.ProposeBatchResponse(), "ProposeBatch")

    async def ProposeStream(self, requests: Any, context: Any) -> Any:
        async for response in self._stream(requests, model_pb2.ProposeBatchResponse, "ProposeBatch",
                                           "/specdec.v1.DraftService/ProposeStream"):
            yield response

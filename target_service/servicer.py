"""TargetService: decode -> target_service.scoring on the scheduler -> encode (Score, ScoreBatch, ScoreStream)."""
from __future__ import annotations

from typing import Any

from engine.host import SessionWork
from specdec.runtime.errors import FailedPrecondition
from model_service.servicer import FEATURE_KIND, ModelServicerBase, fill_response
from specdec.runtime.wire import encode_features
from specdec.v1 import common_pb2, model_pb2, model_pb2_grpc
from target_service.scoring import TOKENS_SCORED, ScoreWork, check_feature_layers, check_score, decode_extras


class TargetServicer(ModelServicerBase, model_pb2_grpc.TargetServiceServicer):
    role = "target"
    response_type = model_pb2.ScoreResponse

    def prepare(self, request: model_pb2.ScoreRequest) -> ScoreWork:
        req = self.decode(request)
        extras = decode_extras(request, req.k, self.host.loaded.vocab_size)
        check_score(req)
        if extras.features and not self.features()[0]:
            raise FailedPrecondition("features: this replica serves its model through the stock forward "
                                     "(--max-batch 1, or an architecture the engine does not know) and "
                                     "returns no features (ModelInfo.feature_dim = 0)")
        check_feature_layers(extras.feature_layers, extras.features, self.host.loaded.num_layers)
        return ScoreWork(req, extras)

    def features(self) -> tuple[int, str]:
        if not getattr(self.host.runner, "pooled", False):
            return 0, ""
        return int(self.host.loaded.model.config.hidden_size), FEATURE_KIND

    def respond(self, request: model_pb2.ScoreRequest, done: SessionWork, started: float,
                response: model_pb2.ScoreResponse) -> model_pb2.ScoreResponse:
        TOKENS_SCORED.inc(len(request.tokens))
        scores = done.value
        response.argmax_ids.extend(scores.argmax_ids)
        if scores.sampled_ids:
            response.sampled_ids.extend(scores.sampled_ids)
        if request.parents:
            response.tree = True
        if scores.logprobs is not None:
            lp = scores.logprobs
            response.logprobs.CopyFrom(common_pb2.Logprobs(
                drafted=lp.next_fed, argmax=lp.argmax, top_n=len(lp.top_ids[0]) if lp.top_ids else 0,
                top_ids=[t for row in lp.top_ids for t in row],
                top_logprobs=[v for row in lp.top_logprobs for v in row],
                sampled=lp.sampled if lp.sampled is not None
                else (lp.argmax if scores.sampled_ids is not None else ())))
        if scores.hidden is not None:
            response.features.CopyFrom(encode_features(scores.hidden, request.features, request.cache_position))
        return fill_response(response, done, started, scores.probs)

    async def Score(self, request: model_pb2.ScoreRequest, context: Any) -> model_pb2.ScoreResponse:
        return await self._single(request)

    async def ScoreBatch(self, request: model_pb2.ScoreBatchRequest, context: Any) -> model_pb2.ScoreBatchResponse:
        return await self._batch(request, model_pb2.ScoreBatchResponse(), "ScoreBatch")

    async def ScoreStream(self, requests: Any, context: Any) -> Any:
        async for response in self._stream(requests, model_pb2.ScoreBatchResponse, "ScoreBatch",
                                           "/specdec.v1.TargetService/ScoreStream"):
            yield response

"""The Orchestrator gRPC servicer: proto in, loop, proto out. Nothing else lives here."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict

import grpc

from orchestrator import check as checking
from orchestrator import metrics
from orchestrator.loop import ChunkEvent, Engine, GenerateSpec, Tally, forget_session, generate
from orchestrator.proposers import DRAFT, GUESS, LOOKUP, NONE
from orchestrator.text import encode_prompt, encode_text
from specdec.errors import InvalidArgument, OutOfRange
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec.wire import sampling_from_proto

_PROPOSERS = {pb.PROPOSER_DRAFT: DRAFT, pb.PROPOSER_LOOKUP: LOOKUP, pb.PROPOSER_GUESS: GUESS,
              pb.PROPOSER_NONE: NONE}


def _prompt_ids(engine: Engine, request: pb.GenerateRequest | pb.CheckRequest) -> list[int]:
    messages = [(m.role, m.content) for m in request.messages]
    ids = encode_prompt(engine.tokenizer, request.prompt, messages)
    if len(ids) >= engine.context_length:
        raise OutOfRange(
            f"prompt: {len(ids)} tokens does not fit the target's context of {engine.context_length}"
        )
    return ids


def spec_from_request(request: pb.GenerateRequest, engine: Engine) -> GenerateSpec:
    """Validate a GenerateRequest; every error names the offending field."""
    prompt_ids = _prompt_ids(engine, request)
    if request.proposer == pb.PROPOSER_UNSPECIFIED:
        proposer = engine.default_proposer
    elif request.proposer in _PROPOSERS:
        proposer = _PROPOSERS[request.proposer]
    else:
        raise InvalidArgument(f"proposer: unknown value {request.proposer}")
    if request.max_new_tokens < 1:
        raise InvalidArgument("max_new_tokens: must be >= 1")
    if request.max_new_tokens > engine.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens: {request.max_new_tokens} is above this server's limit of "
            f"{engine.max_new_tokens_limit}"
        )
    if len(prompt_ids) + request.max_new_tokens > engine.context_length:
        raise OutOfRange(
            f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
            f"({request.max_new_tokens}) exceeds the target's context of {engine.context_length}"
        )
    if request.k > engine.max_k:
        raise InvalidArgument(f"k: {request.k} is above the services' limit of {engine.max_k}")
    if any(not s for s in request.stop):
        raise InvalidArgument("stop: stop strings must be non-empty")
    guess_ids: list[int] = []
    if proposer == GUESS:
        if not request.guess:
            raise InvalidArgument("guess: required when proposer is PROPOSER_GUESS")
        guess_ids = encode_text(engine.tokenizer, request.guess)
    return GenerateSpec(
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=int(request.max_new_tokens),
        sampling=sampling_from_proto(request.sampling if request.HasField("sampling") else None),
        seed=int(request.seed),
        stop=tuple(request.stop),
        proposer=proposer,
        k=int(request.k),
        guess_ids=tuple(guess_ids),
        session_id=request.session_id,
        strict=request.strict,
    )


def stats_to_proto(t: Tally) -> pb.Stats:
    return pb.Stats(
        session_id=t.session_id, finish_reason=t.finish_reason, proposer=t.proposer,
        fallback_reason=t.fallback_reason, prompt_tokens=t.prompt_tokens,
        reused_prompt_tokens=t.reused_prompt_tokens, new_tokens=t.new_tokens,
        target_passes=t.target_passes, draft_calls=t.draft_calls,
        drafted_tokens=t.drafted_tokens, accepted_tokens=t.accepted_tokens,
        acceptance_rate=t.acceptance_rate, accepted_per_round=t.accepted_per_round,
        drafted_per_round=t.drafted_per_round,
        acceptance_by_position=t.acceptance_by_position, cache_misses=t.cache_misses,
        ttft_ms=t.ttft_ms, total_ms=t.total_ms, draft_ms=t.draft_ms, target_ms=t.target_ms,
        network_ms=t.network_ms, orchestrator_ms=t.orchestrator_ms, redis_ms=t.redis_ms,
        bytes_sent=t.bytes_sent, bytes_received=t.bytes_received, seed=t.seed,
        target_replica=t.target_replica, draft_replica=t.draft_replica,
        overhead_p50_ms=t.overhead_p50_ms, serialize_ms=t.serialize_ms,
        rounds=[pb.Round(**asdict(r)) for r in t.rounds],
    )


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        spec = spec_from_request(request, self.engine)
        async for event in generate(spec, self.engine):
            if isinstance(event, ChunkEvent):
                yield pb.GenerateResponse(chunk=pb.Chunk(text=event.text, token_ids=event.token_ids))
            else:
                metrics.observe(event)
                yield pb.GenerateResponse(stats=stats_to_proto(event))

    async def Check(  # noqa: N802
        self, request: pb.CheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckResponse:
        tok = self.engine.tokenizer
        prompt_ids = _prompt_ids(self.engine, request)
        guess_ids = encode_text(tok, request.guess)
        result = await checking.check(self.engine.router, prompt_ids, guess_ids, self.engine.max_check)
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
        mismatch = result.first_mismatch
        return pb.CheckResponse(
            accepted=result.accepted,
            first_mismatch=mismatch,
            accepted_text=decode(guess_ids[: result.accepted]),
            target_text_at_mismatch=decode([result.positions[mismatch].predicted_id]) if mismatch >= 0 else "",
            positions=[
                pb.TokenPrediction(
                    position=p.position, guess_id=p.guess_id, guess_text=decode([p.guess_id]),
                    predicted_id=p.predicted_id, predicted_text=decode([p.predicted_id]),
                    guess_prob=p.guess_prob, predicted_prob=p.predicted_prob,
                )
                for p in result.positions
            ],
            next_id=result.next_id,
            next_text=decode([result.next_id]),
        )

    async def EndSession(  # noqa: N802
        self, request: pb.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndSessionResponse:
        if not request.session_id:
            raise InvalidArgument("session_id: required")
        record = await self.engine.store.load(request.session_id)
        if record is None:
            return pb.EndSessionResponse(existed=False)
        clients = [
            self.engine.router.client(record.target, "target") if record.target else None,
            self.engine.router.client(record.draft, "draft") if record.draft else None,
        ]
        await forget_session(request.session_id, self.engine.store, clients)
        return pb.EndSessionResponse(existed=True)

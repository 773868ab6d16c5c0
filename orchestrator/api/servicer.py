"""The Orchestrator gRPC servicer: proto in, loop, proto out. Nothing else lives here.

The tenant's rate comes first (a refused request costs a call too), then the request's
bounds (orchestrator.api.bounds: stop strings, prediction, grammar, top_logprobs) and the
tenant's quota (specdec.runtime.limits): the request's text bytes against
--max-request-bytes, then the tenant's stream slots (n for a request of n choices; Check and
Predict take one, and a target slot too). Tokenising,
chat templating and decoding run on a thread pool, off the event loop, so one
huge request does not stall the other streams. A session is visible only to
the tenant that created it (specdec.runtime.security.TENANT).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from orchestrator.api import chat
from orchestrator.api import bounds as bounding
from orchestrator.api import check as checking
from orchestrator.api import predict as predicting
from orchestrator.api import tokens
from orchestrator.api import metrics
from orchestrator.api.choices import SharedPrefill, choice_requests, merged, resumed_choices
from orchestrator.api.interval import ChunkGatherer
from orchestrator.api.multiplex import Multiplexer
from orchestrator.common.grammar import Constraint
from orchestrator.common.events import ChunkEvent, RoundDetail, TokenLogprob
from orchestrator.round.loop import generate
from orchestrator.round.sessions import forget_session, retry_redis
from orchestrator.common.kinds import GUESS, PREDICTED_OUTPUT
from orchestrator.config import LoopConfig
from orchestrator.common.request import TurnRequest
from orchestrator.common.stats import stats_to_proto
from orchestrator.common.text import encode_prompt, encode_text, tool_call_format
from specdec.runtime.errors import DeadlineExceeded, InvalidArgument, OutOfRange
from specdec.runtime.limits import MAX_CHOICES, MAX_SESSION_ID, RequestLimits, TenantQuota, TenantLimits
from specdec.runtime.security import TENANT
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec.runtime.wire import sampling_from_proto



def served_proposers(config: LoopConfig) -> list[str]:
    """ServedModel.proposers: the kinds a request may name, the default first."""
    names = config.homes.requestable()
    return sorted(names, key=lambda name: name != config.default_proposer)


def proposer_kind(request: pb.GenerateRequest, config: LoopConfig) -> str:
    """The kind a request names: proposer_name, else the enum (its value names a registered kind's
    `wire`), else the config's default. Unknown names and values are INVALID_ARGUMENT."""
    kinds = config.homes.kinds
    by_enum = ""
    if request.proposer != pb.PROPOSER_UNSPECIFIED:
        wire = pb.Proposer.Name(request.proposer) if request.proposer in pb.Proposer.values() else ""
        by_enum = next((k.name for k in kinds.values() if wire and k.wire == wire), "")
        if not by_enum:
            raise InvalidArgument(f"proposer: unknown value {request.proposer}")
    name = request.proposer_name
    if not name:
        return by_enum or config.default_proposer
    if name not in kinds or not kinds[name].requestable:
        raise InvalidArgument(f"proposer_name: unknown proposer {name[:64]!r}; this server has "
                              f"{', '.join(config.homes.requestable())}")
    if by_enum and by_enum != name:
        raise InvalidArgument(f"proposer_name: {name!r} and proposer {pb.Proposer.Name(request.proposer)} "
                              "name different kinds")
    return name


def _prompt_ids(config: LoopConfig, request: pb.GenerateRequest | pb.CheckRequest) -> list[int]:
    ids = encode_prompt(config.tokenizer, request.prompt, chat.messages(request), chat.tools(request))
    if len(ids) >= config.context_length:
        raise OutOfRange(
            f"prompt: {len(ids)} tokens does not fit the target's context of {config.context_length}"
        )
    return ids


T = TypeVar("T")


def text_bytes(request: pb.GenerateRequest | pb.CheckRequest | pb.TokenizeRequest) -> int:
    """UTF-8 bytes of every text field a request carries, its constraint's included (checked
    before any tokenising)."""
    size = len(request.prompt.encode()) + len(getattr(request, "guess", "").encode())
    size += len(getattr(request, "prediction", "").encode())
    size += sum(len(m.role.encode()) + len(m.content.encode()) for m in request.messages)
    size += chat.text_bytes(request)
    size += bounding.constraint_bytes(request)
    return size + sum(len(s.encode()) for s in getattr(request, "stop", ()))


def turn_request(request: pb.GenerateRequest, config: LoopConfig,
                      tenant: str = "") -> TurnRequest:
    """Validate a GenerateRequest; every error names the offending field."""
    if len(request.session_id) > MAX_SESSION_ID:
        raise InvalidArgument(f"session_id: at most {MAX_SESSION_ID} characters")
    prompt_ids = _prompt_ids(config, request)
    proposer = proposer_kind(request, config)
    if request.max_new_tokens < 1:
        raise InvalidArgument("max_new_tokens: must be >= 1")
    if request.max_new_tokens > config.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens: {request.max_new_tokens} is above this server's limit of "
            f"{config.max_new_tokens_limit}"
        )
    if len(prompt_ids) + request.max_new_tokens > config.context_length:
        raise OutOfRange(
            f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
            f"({request.max_new_tokens}) exceeds the target's context of {config.context_length}"
        )
    if request.k > config.max_k:
        raise InvalidArgument(f"k: {request.k} is above the services' limit of {config.max_k}")
    if any(not s for s in request.stop):
        raise InvalidArgument("stop: stop strings must be non-empty")
    _check_choices(request)
    _check_dialect(request, config)
    delivered = _delivered(request, len(prompt_ids), config)
    sampling = sampling_from_proto(request.sampling if request.HasField("sampling") else None)
    guess_ids: list[int] = []
    if request.prediction:
        named = request.proposer != pb.PROPOSER_UNSPECIFIED or request.proposer_name
        if (named and proposer != GUESS) or request.guess:
            raise InvalidArgument("prediction: only with proposer PROPOSER_UNSPECIFIED (or "
                                  "PROPOSER_GUESS without a guess): the prediction is the proposal")
        proposer = PREDICTED_OUTPUT
        guess_ids = encode_text(config.tokenizer, request.prediction)
    elif proposer == GUESS:
        if not request.guess:
            raise InvalidArgument("guess: required when proposer is PROPOSER_GUESS")
        guess_ids = encode_text(config.tokenizer, request.guess)
    return TurnRequest(
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=int(request.max_new_tokens),
        sampling=sampling,
        seed=int(request.seed),
        stop=tuple(request.stop),
        proposer=proposer,
        k=int(request.k),
        guess_ids=tuple(guess_ids),
        session_id=request.session_id,
        strict=request.strict,
        keep_session=request.keep_session,
        resume_from=int(request.resume_from),
        delivered=delivered,
        round_tokens=request.round_tokens,
        max_target_passes=int(request.max_target_passes),
        ignore_eos=request.ignore_eos,
        constraint=_constraint(config, request),
        logprobs=request.logprobs,
        top_logprobs=_top_logprobs(request),
        tenant=tenant,
        parallel=_SPECULATION.get(request.speculation, None),
        coupled=config.couples(sampling, int(request.seed)),
        min_tokens=int(request.min_tokens),
        stop_token_ids=tuple(request.stop_token_ids),
        keep_special_tokens=request.keep_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )


def _check_dialect(request: pb.GenerateRequest, config: LoopConfig) -> None:
    """min_tokens and stop_token_ids (vLLM's request extensions)."""
    if request.min_tokens > request.max_new_tokens:
        raise InvalidArgument(f"min_tokens: {request.min_tokens} is above max_new_tokens "
                              f"({request.max_new_tokens})")
    vocab = config.vocab_size or len(config.tokenizer)
    bad = [t for t in request.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})")


MAX_TOP_LOGPROBS = 20


def _constraint(config: LoopConfig, request: pb.GenerateRequest) -> Constraint | None:
    """GenerateRequest.constraint; compiled next, off the loop (orchestrator.api.bounds.prepare), so a
    bad grammar fails before the stream."""
    if not request.HasField("constraint"):
        return None
    if request.ignore_eos:
        raise InvalidArgument("ignore_eos: not with a constraint (a grammar ends at EOS)")
    kind = request.constraint.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("constraint: set one of json_schema, json_object, regex, lark")
    value = getattr(request.constraint, kind)
    if kind == "json_object":
        if not value:
            return None  # json_object = false: free text
        constraint = Constraint(kind)
    else:
        if not value:
            raise InvalidArgument(f"constraint.{kind}: must not be empty")
        constraint = Constraint(kind, value)
    return constraint


def _top_logprobs(request: pb.GenerateRequest) -> int:
    n = int(request.top_logprobs)
    if n > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs: {n} is above the limit of {MAX_TOP_LOGPROBS}")
    if n and not request.logprobs:
        raise InvalidArgument("top_logprobs: requires logprobs")
    return n


def _check_choices(request: pb.GenerateRequest) -> None:
    """n > 1 runs n single-turn sessions: nothing to continue, and a resume names no session."""
    if request.n > MAX_CHOICES:
        raise InvalidArgument(f"n: {request.n} is above this server's limit of {MAX_CHOICES}")
    if request.n > 1:
        for name in ("session_id", "keep_session", "resume_from"):
            if getattr(request, name):
                raise InvalidArgument(f"{name}: not with n > 1 (each choice is a single-turn "
                                      "session; a resume sends `delivered`)")


def _delivered(request: pb.GenerateRequest, prompt_len: int, config: LoopConfig) -> tuple[int, ...] | None:
    """Choice 0's delivered tokens of a resume (None where none were sent), every entry checked.

    n = 1: at most one entry, index 0, whose tokens end at resume_from. n > 1:
    one entry per choice at most; the servicer hands each choice its own.
    """
    entries = list(request.delivered)
    if not entries:
        return None
    n = max(1, request.n)
    seen: set[int] = set()
    for e in entries:
        if e.index >= n or e.index in seen:
            raise InvalidArgument(f"delivered: index {e.index} is not a choice of this request (n = {n}) "
                                  "or appears twice")
        seen.add(e.index)
        if len(e.token_ids) > request.max_new_tokens:
            raise InvalidArgument(f"delivered: {len(e.token_ids)} tokens for choice {e.index}, more than "
                                  f"max_new_tokens ({request.max_new_tokens})")
        if any(not 0 <= t < config.vocab_size for t in e.token_ids) and config.vocab_size:
            raise InvalidArgument(f"delivered: a token of choice {e.index} is outside the vocabulary "
                                  f"[0, {config.vocab_size})")
    first = next((e for e in entries if e.index == 0), None)
    tokens = tuple(first.token_ids) if first is not None else ()
    if n == 1:
        if not request.resume_from:
            raise InvalidArgument("delivered: only with resume_from (a resume of a stream)")
        if request.resume_from != prompt_len + len(tokens):
            raise InvalidArgument(f"resume_from: {request.resume_from} must be the index after the "
                                  f"delivered tokens ({prompt_len} prompt + {len(tokens)} delivered)")
    return tokens


# Request.speculation -> TurnRequest.parallel (None: the orchestrator's default); an
# unknown value from a newer client is taken as unspecified.
_SPECULATION = {pb.SPECULATION_SEQUENTIAL: False, pb.SPECULATION_PARALLEL: True}


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, config: LoopConfig, limits: TenantLimits | None = None,
                 text_threads: int = 2, bounds: RequestLimits | None = None,
                 stream_interval: int = 1) -> None:
        self.config = config
        self.stream_interval = max(1, stream_interval)  # tokens per chunk message (orchestrator.api.interval)
        self.quota = TenantQuota(limits or TenantLimits())
        self.bounds = bounds or RequestLimits()
        self._text_pool = ThreadPoolExecutor(max(1, text_threads), thread_name_prefix="text")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self._generation(request):
            yield response

    async def GenerateMany(  # noqa: N802
        self, requests: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        """Many generations over one stream, each run as Generate runs it (orchestrator.api.multiplex)."""
        async for response in Multiplexer(self._generation).serve(requests):
            yield response

    async def _generation(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate call's responses (raises what its status is made from)."""
        tenant = TENANT.get()
        self.quota.rate(tenant)  # first: a refused request costs its tenant a call too
        bounding.check(request, self.bounds)
        self.quota.check_bytes(text_bytes(request))
        with self.quota.enter(tenant, streams=min(max(1, request.n), MAX_CHOICES), rated=True):
            if request.keep_session:
                await self._room_to_keep(tenant, request.session_id)
            req = await self._off_loop(turn_request, request, self.config, tenant)
            req = await bounding.prepare(req, self.config.grammars, self.bounds, self._off_loop)
            reqs = choice_requests(req, request.n)
            if len(reqs) == 1:
                responses = self._generate(req)
            elif request.delivered:  # a resume of n > 1: each unfinished choice from its tokens
                responses = merged([self._generate(s, resumable=False)
                                    for s in resumed_choices(reqs, request.delivered)])
            else:  # choices 1.. start from choice 0's prefilled prompt (orchestrator.api.choices)
                shared = SharedPrefill(self.config, reqs)
                responses = merged([self._generate(reqs[0], resumable=False, shared=shared)]
                                   + [self._choice(s, shared) for s in reqs[1:]])
            async with contextlib.aclosing(responses):
                ends = time.monotonic() + self.quota.limits.max_stream_s
                async for response in responses:
                    if self.quota.limits.max_stream_s and time.monotonic() > ends:
                        raise DeadlineExceeded(
                            f"max_stream_seconds: the stream ran past this server's limit of "
                            f"{self.quota.limits.max_stream_s:g} s (--max-stream-seconds)")
                    yield response

    async def _room_to_keep(self, tenant: str, session_id: str) -> None:
        """A request that may make a kept session: RESOURCE_EXHAUSTED past the tenant's
        --max-kept-sessions-per-tenant (counted in Redis; concurrent new ones may pass it by the
        tenant's streams in flight). Only a later turn of the tenant's own kept session is no new
        one: a new id, a resume of an id nobody holds (which would start a record under it), and
        a single-turn session turned kept all count."""
        count = getattr(self.config.store, "kept", None)  # None: a store that does not count
        if not self.quota.limits.max_kept_sessions or count is None:
            return
        if session_id:
            record = await retry_redis(lambda: self.config.store.load(session_id),
                                       self.config.redis_outage_s, "session load")
            if record is not None and record.tenant == tenant and record.multi_turn:
                return  # already counted
        held = await retry_redis(lambda: count(tenant), self.config.redis_outage_s, "kept sessions")
        self.quota.check_kept(held)

    async def _choice(self, req: TurnRequest, shared: SharedPrefill) -> AsyncIterator[pb.GenerateResponse]:
        """Choice i > 0 of n: waits for choice 0's prefill, then runs from its fork."""
        started = False
        try:
            req = await shared.spec_for(req)
            started = True
            async for response in self._generate(req, resumable=False):
                yield response
        finally:
            if not started:  # cancelled while waiting: the fork made for it goes
                await asyncio.shield(shared.discard(req.index))

    async def _generate(self, req: TurnRequest, resumable: bool = True,
                        shared: SharedPrefill | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """One choice's responses; a choice of n > 1 names no session (it cannot be resumed).
        Choice 0 of n > 1 (`shared`) hands its first chunk's replicas to the others' forks."""
        try:
            async for response in self._responses(req, resumable, shared):
                yield response
        finally:
            if shared is not None:
                shared.give_up()

    async def _responses(self, req: TurnRequest, resumable: bool,
                         shared: SharedPrefill | None) -> AsyncIterator[pb.GenerateResponse]:
        gather = ChunkGatherer(self.stream_interval) if self.stream_interval > 1 else None
        async for event in generate(req, self.config):
            if shared is not None and isinstance(event, ChunkEvent):
                await shared.offer(event)  # the loop waits at this chunk: its KV is still held
            if isinstance(event, ChunkEvent):
                if gather is not None and (event := gather.add(event)) is None:
                    continue  # held: the stream interval (orchestrator.api.interval)
                yield self._chunk(event, req.index, resumable)
            else:
                if gather is not None and (held := gather.flush()) is not None:
                    yield self._chunk(held, req.index, resumable)
                metrics.observe(event)
                yield pb.GenerateResponse(stats=stats_to_proto(event))
        if gather is not None and (held := gather.flush()) is not None:
            yield self._chunk(held, req.index, resumable)

    def _chunk(self, event: ChunkEvent, index: int, resumable: bool) -> pb.GenerateResponse:
        # Filled in place: a Chunk built apart and passed in is copied (a few µs per stream-round).
        response = pb.GenerateResponse()
        chunk = response.chunk
        chunk.SetInParent()
        chunk.text = event.text
        chunk.token_ids.extend(event.token_ids)
        chunk.start_index = event.start_index
        if resumable and event.session_id:
            chunk.session_id = event.session_id
        chunk.index = index
        if event.round:
            chunk.round.CopyFrom(self._round_tokens(event.round))
        if event.logprobs:
            chunk.logprobs.extend(self._logprob(lp) for lp in event.logprobs)
        return response

    def _decode_each(self, ids: list[int]) -> list[str]:
        """Every token decoded alone (special tokens shown), as Check and Predict report them."""
        tok = self.config.tokenizer
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    def _logprob(self, lp: TokenLogprob) -> pb.TokenLogprob:
        token_bytes = self.config.grammars.token_bytes
        return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=lp.top_ids,
                               top_logprobs=lp.top_logprobs, token_bytes=token_bytes(lp.token_id),
                               top_bytes=[token_bytes(t) for t in lp.top_ids])

    def _round_tokens(self, detail: RoundDetail) -> pb.RoundTokens:
        # At most max_k + 1 short decodes: cheap enough to stay on the loop.
        return pb.RoundTokens(
            round=detail.index, source=detail.source, drafted_ids=detail.drafted,
            drafted_texts=self._decode_each(detail.drafted), accepted=detail.accepted,
            extra_kind=detail.extra_kind, token_texts=self._decode_each(detail.committed))

    async def Predict(  # noqa: N802
        self, request: pb.PredictRequest, context: grpc.aio.ServicerContext
    ) -> pb.PredictResponse:
        tenant = TENANT.get()
        self.quota.rate(tenant)
        self.quota.check_bytes(len(request.text.encode()))
        top_k = predicting.top_k_of(request.top_k)
        sampling = predicting.predict_sampling(
            sampling_from_proto(request.sampling) if request.HasField("sampling") else None)
        with self.quota.enter(tenant, rated=True):
            ids = await self._off_loop(self._predict_ids, request.text)
            result = await predicting.predict(self.config.router, ids, sampling,
                                              self.config.target_max_k,
                                              distributions=request.distributions, tenant=tenant,
                                              admission=self.config.admission,
                                              wait_s=self.config.target_wait_s)
            return await self._off_loop(self._predict_response, result, top_k)

    def _predict_ids(self, text: str) -> list[int]:
        if not text:
            raise InvalidArgument("text: must not be empty")
        ids = encode_text(self.config.tokenizer, text)
        if len(ids) >= self.config.context_length:
            raise OutOfRange(f"text: {len(ids)} tokens does not fit the target's context of "
                             f"{self.config.context_length}")
        return ids

    def _predict_response(self, result: predicting.Prediction, top_k: int) -> pb.PredictResponse:
        texts = self._decode_each(result.ids)
        rows = [predicting.top_candidates(row, top_k) for row in result.probs]
        wanted = sorted({i for row in rows for i, _ in row})
        names = dict(zip(wanted, self._decode_each(wanted)))

        def candidates(row: list[tuple[int, float]]) -> list[pb.Candidate]:
            return [pb.Candidate(id=i, text=names[i], prob=p) for i, p in row]

        tokens = []
        for n, (token, text) in enumerate(zip(result.ids, texts)):
            r = n - result.scored_from  # the row that predicted this token, if scored
            scored = r >= 0
            tokens.append(pb.PredictedToken(
                id=token, text=text, predicted=candidates(rows[r]) if scored else [],
                prob=float(result.probs[r, token]) if scored else 0.0))
        return pb.PredictResponse(
            tokens=tokens, next=candidates(rows[-1]), target_next=result.target_next,
            draft_next=result.draft_next, target_passes=1,
            draft_calls=int(result.draft_next is not None))

    async def Check(  # noqa: N802
        self, request: pb.CheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckResponse:
        tenant = TENANT.get()
        self.quota.rate(tenant)
        self.quota.check_bytes(text_bytes(request))
        with self.quota.enter(tenant, rated=True):
            prompt_ids, guess_ids = await self._off_loop(self._check_ids, request)
            result = await checking.check(self.config.router, prompt_ids, guess_ids,
                                          self.config.target_max_k, tenant, self.config.admission,
                                          self.config.target_wait_s)
            return await self._off_loop(self._check_response, guess_ids, result)

    def _check_ids(self, request: pb.CheckRequest) -> tuple[list[int], list[int]]:
        return _prompt_ids(self.config, request), encode_text(self.config.tokenizer, request.guess)

    def _check_response(self, guess_ids: list[int], result: Any) -> pb.CheckResponse:
        tok = self.config.tokenizer
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

    async def GetServedModel(  # noqa: N802
        self, request: pb.GetServedModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServedModel:
        config = self.config
        return pb.ServedModel(model_name=config.model_name, context_length=config.context_length,
                              tool_call_format=tool_call_format(config.tokenizer),
                              max_new_tokens_limit=config.max_new_tokens_limit,
                              draft_mode=config.draft_mode, proposers=served_proposers(config))

    async def Tokenize(  # noqa: N802
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        self.quota.rate(TENANT.get())
        self.quota.check_bytes(text_bytes(request))
        return await self._off_loop(tokens.tokenize, self.config.tokenizer, request,
                                    self.config.context_length)

    async def Detokenize(  # noqa: N802
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        self.quota.rate(TENANT.get())
        return await self._off_loop(tokens.detokenize, self.config.tokenizer, request,
                                    self.config.vocab_size or len(self.config.tokenizer))

    async def EndSession(  # noqa: N802
        self, request: pb.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndSessionResponse:
        if not request.session_id:
            raise InvalidArgument("session_id: required")
        if len(request.session_id) > MAX_SESSION_ID:
            raise InvalidArgument(f"session_id: at most {MAX_SESSION_ID} characters")
        self.quota.rate(TENANT.get())
        record = await self.config.store.load(request.session_id)
        if record is None or record.tenant != TENANT.get():  # another tenant's: as if unknown
            return pb.EndSessionResponse(existed=False)
        clients = [
            self.config.router.client(record.target, "target") if record.target else None,
            self.config.router.client(record.draft, "draft") if record.draft else None,
        ]
        await forget_session(request.session_id, self.config.store, clients)
        return pb.EndSessionResponse(existed=True)

"""The speculative decoding loop: propose, score, verify, commit — one round at a time.

`generate(req, config)` is an async generator of `ChunkEvent`s and a final
`Tally`. Each round:

  1. propose  the proposer drafts d_1..d_k (and q): one RPC for a draft model
  2. score    one RPC to the target: one forward over the uncached committed
              tokens + d_1..d_k, returning p (or argmax) at the last k + 1 positions
  3. verify   with specdec.core.verify: accept d_1..d_m, plus one recovered/bonus token
  4. commit   cut at EOS / max_new_tokens / stop string, crop both caches'
              bookkeeping, save the session (one Redis transaction), stream

A cache miss from either service resends every committed token from position 0
(the text cannot change: the tokens are the same); a dead replica is replaced
(orchestrator.remote.SessionReplica). The proposer handles its own failures
(orchestrator.proposers.base), statistics live in orchestrator.round.stats and the
session's lifecycle in orchestrator.sessions.

A resume (`resume_from`, after the stream's orchestrator died) continues the
turn from the tokens the client received (TurnRequest.delivered, or the
record's where an older client sends none: orchestrator.round.sessions): they are
committed first, through the decoder, the stop-string hold-back and the
grammar, whose text was streamed already; the rounds then draft after them.
Each chunk carries the absolute index of its first token.

Sampling (specdec.core.verify): a request with `coupled` set (every seeded
one) verifies by the coupled sampler: the target returns its draw at each
scored position and a drafted token is accepted iff it equals that draw, so
the text is the target-only sample for the seed whatever was drafted. Others
verify by rejection sampling on the target's p and the draft's q.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import math
import time

import torch

from orchestrator.round.grammar import RoundMasks
from orchestrator.proposers.factory import open_proposer
from orchestrator.proposers.base import DraftContext, Proposal, Proposer
from orchestrator.fleet.remote import ModelClient, Reply, SessionReplica
from orchestrator.round.sessions import Session, open_session
from orchestrator.proposers.kinds import PREDICTION
from orchestrator.config import LoopConfig
from orchestrator.request import TurnRequest, WireSampling
from orchestrator.round.stats import RoundTally, Tally, Timer
from orchestrator.round.text import IncrementalDecoder
from specdec.runtime import tracing
from specdec.core.fingerprint import extend, prefix_fingerprints
from specdec.core.kv import crop_lengths
from specdec.core.speedup import GoodputPolicy
from specdec.core.stopping import STOP, StopStringHoldback, clip_to_stop
from specdec.core.verify import Verdict, verify_coupled, verify_greedy, verify_sampled
from specdec.runtime.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs


# finish_reason of a turn stopped by TurnRequest.max_target_passes.
PASSES = "passes"
# RoundTokens.source of a round whose drafts are all grammar-forced (orchestrator.round.grammar).
GRAMMAR = "grammar"


@dataclass(frozen=True)
class RoundDetail:
    """What one round proposed and committed (TurnRequest.round_tokens): Chunk.round."""

    index: int  # 1-based: the target passes so far
    source: str  # what drafted ("" = nothing)
    drafted: list[int]
    accepted: int
    extra_kind: str  # specdec.core.verify RECOVERED or BONUS
    committed: list[int]  # accepted drafts + the extra token, after EOS / stop / length cuts


@dataclass(frozen=True)
class ChunkEvent:
    text: str
    token_ids: list[int]
    start_index: int = 0  # index of token_ids[0] in the session's tokens (prompt included)
    session_id: str = ""  # on the stream's first chunk (what a resume names)
    round: RoundDetail | None = None  # req.round_tokens only
    logprobs: list[TokenLogprob] | None = None  # req.logprobs only: one per token_ids entry
    # On the first chunk: the target and draft replicas holding the session's KV ("" = none),
    # which the other choices of an n > 1 request fork the prefilled prompt from.
    replicas: tuple[str, str] = ("", "")


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a committed token (model.proto Logprobs says which p)."""

    token_id: int
    logprob: float
    top_ids: list[int]  # req.top_logprobs alternatives, most likely first
    top_logprobs: list[float]


async def generate(req: TurnRequest, config: LoopConfig) -> AsyncIterator[ChunkEvent | Tally]:
    """Run the loop for one request: ChunkEvents as tokens commit, then the Tally."""
    # Round 1's clock starts with the request (the Tally's): it carries the set-up below.
    tally = Tally(prompt_tokens=len(req.prompt_ids), index=req.index)  # open_session sets the seed
    trace = tracing.request(tally)  # spans on the Tally's clock; a no-op unless tracing is on
    session = await open_session(req, config, tally)  # admitted: a slot on its target replica
    rounds = _rounds(req, config, session, tally, trace)
    try:
        async for event in rounds:
            yield event
    finally:
        await rounds.aclose()  # a consumer that stopped early: the rounds' own clean-up runs now
        config.admission.leave(session.target)


async def _rounds(req: TurnRequest, config: LoopConfig, session: Session, tally: Tally,
                  trace) -> AsyncIterator[ChunkEvent | Tally]:
    """The rounds of an admitted request (see the module docstring)."""
    with Timer(tally, "redis_ms"):  # routing reads the registry
        proposer = await open_proposer(req, config, session.id, session.draft_home(),
                                       target=lambda: session.target.address)
    sampling = WireSampling.encode(req.sampling, coupled=req.coupled)  # once per request, not per RPC
    tokens = list(session.prefix)  # the prompt, then (a resume) the tokens the client has
    fps = prefix_fingerprints(tokens)  # fps[i] = fingerprint(tokens[:i])
    adaptive = GoodputPolicy() if not req.k and config.adaptive_k and proposer.adaptive else None
    k_max = config.max_k if adaptive is not None else req.k or config.default_k
    # No k in the request: whether drafting pays on the target replica is measured (orchestrator.policy.gate);
    # not for a caller's prediction, which is asked for and costs no draft work.
    gated = not req.k and proposer.proposes and config.speculation_gate and req.proposer != PREDICTION
    gate = None
    decoder = IncrementalDecoder(config.tokenizer, req.prompt_ids)
    holdback = StopStringHoldback(req.stop) if req.stop else None
    # Structured output: the turn's grammar state (orchestrator.round.grammar), advanced along commits.
    matcher = config.grammars.matcher(req.constraint) if req.constraint is not None else None
    finish = _replay_delivered(req, config, tokens[len(req.prompt_ids):], decoder, holdback, matcher)
    tally.new_tokens = len(tokens) - len(req.prompt_ids)
    n_logprobs = max(req.top_logprobs, 1) if req.logprobs else 0  # the argmax's comes with the top 1
    sent = 0  # chunks streamed
    prefetch: asyncio.Future | None = None  # a first round's feeding of the draft (proposer.prefetch)

    def away() -> None:  # drafting: the target's batch calls do not wait for this session meanwhile
        session.target.client.leave(session.target.session_id)
    try:
        while not finish:
            rnd = RoundTally()
            remaining = req.max_new_tokens - len(tokens) + len(req.prompt_ids)
            if gated and gate is not config.costs.gate(session.target.address):  # first round, or moved
                if gate is not None:
                    gate.leave()
                gate = config.costs.gate(session.target.address)
                gate.enter()
            draft_off = False
            if proposer.proposes:  # the round's extra token fills the last slot
                if gate is not None and not gate.allows():
                    # This epoch measures plain decoding (or plain decoding measured better): no draft
                    # model. A lone session's proposer with free guesses keeps those that pay by
                    # themselves; under load a plain epoch is target-only rounds, the gate's baseline.
                    draft_off = getattr(proposer, "free_guesses", False) and gate.live <= 1
                    k = k_max if draft_off else 0
                else:
                    k = k_max if adaptive is None else _adaptive_k(adaptive, config, session.target, proposer, k_max)
                rnd.k = max(0, min(k, remaining - 1))
            ctx = DraftContext(session.id, tokens, fps, len(req.prompt_ids), rnd.k, sampling, tally.seed,
                               away=away, draft_off=draft_off)
            prefetch = None
            if (gated and rnd.k and not draft_off and not tally.target_passes and getattr(proposer, "prefetch", None)
                    and proposer.lags(ctx)):
                # A new prompt: the draft is fed it while the target scores it (its first-round
                # drafts would cost the draft's prefill before the target's); drafting starts next round.
                ctx = replace(ctx, draft_off=True)
                prefetch = asyncio.ensure_future(proposer.prefetch(ctx))

            # 1. Propose (the proposer recovers from its own failures).
            with trace.step("propose"):
                proposal = await proposer.propose(ctx)
            drafted = proposal.tokens[: rnd.k]
            own = len(drafted)  # the proposer's own tokens in `drafted` (the rest: grammar-forced)
            masks = None
            if matcher is not None:  # drafted tokens the grammar forbids cannot commit: cut them
                send_invalid = not ctx.sampling.params.greedy and proposal.probs is not None
                masks = matcher.round_masks(drafted, send_first_invalid=send_invalid, k=rnd.k)
                drafted, own = masks.proposal(drafted), masks.sent
            rnd.source = ((proposal.source or proposer.name) if own else GRAMMAR) if drafted else ""
            tally.draft_calls += proposal.call is not None
            if proposal.call is None and proposer.replica is not None:
                # No draft call this round: the draft's batch calls need not wait for this session.
                proposer.replica.client.leave(proposer.replica.session_id)
            rnd.add_proposal(proposal)  # its draft call, or the pre-draft it used (parallel)

            # 2. Score: one target forward over the uncached tokens and the drafts.
            relay = proposer.features if proposer.proposes else None
            if relay is not None:  # what the target skips, the relay must hold the features of
                session.target.held = min(session.target.held, relay.known)
            with trace.step("score"):
                reply = await _score(session.target, ctx, drafted, config.target_wait_s, masks, n_logprobs,
                                     relay.encoding if relay is not None else 0)
            tally.target_passes += 1
            if prefetch is not None:
                if prefetch.done():
                    held = prefetch.result()
                    if held is not None:  # the draft now holds the scored prefix
                        proposal = replace(proposal, cache_length=held)
                else:  # the chunk does not wait for the draft; its next Propose does
                    proposer.keep_feeding(prefetch)
                prefetch = None
            rnd.add_call(reply.call, "target", reply.cache_misses, reply.deadline_misses)
            _observe_costs(config, session.target, proposer, proposal, reply, len(drafted))

            # 3. Verify.
            with trace.step("verify"):
                p = None if ctx.sampling.params.greedy or ctx.sampling.coupled else decode_probs(reply.response.probs)
                verdict = _verify(ctx, drafted, _draft_q(proposal, own, masks, p), reply.response, p)
            tally.add_verdict(len(drafted), verdict)
            rnd.drafted, rnd.accepted = len(drafted), verdict.accepted
            own_accepted = min(verdict.accepted, own)  # what the proposer itself got right
            if adaptive is not None and proposer.proposes:
                adaptive.observe(own, own_accepted)
            proposer.observe(own, own_accepted)

            # 4. Commit: EOS / length / stop string, then cache bookkeeping, Redis, stream.
            committed, finish = clip_to_stop(verdict.tokens, eos_ids=() if req.ignore_eos else config.eos_ids,
                                             remaining=remaining)
            text, committed, hit = _detokenize(committed, decoder, holdback)
            finish = STOP if hit else finish
            if matcher is not None:
                matcher.commit(committed)
            if relay is not None:  # the features of the committed tokens the target has read
                sent_before = relay.sent
                relay.absorb(reply.response.features, len(tokens) + min(len(committed), verdict.accepted))
                rnd.feature_bytes += len(reply.response.features.data) + relay.sent - sent_before
            if not finish and req.max_target_passes and tally.target_passes >= req.max_target_passes:
                finish = PASSES  # a pass budget (the playground's quota): no further forward
            session.target.held, draft_len = crop_lengths(
                committed_before=len(tokens), n_drafted=len(drafted), n_accepted=verdict.accepted,
                # The draft's own cache holds its tokens, not grammar-forced ones after them.
                draft_held=min(proposal.cache_length, len(tokens) + own) if own < len(drafted)
                else proposal.cache_length, n_committed=len(committed),
            )
            proposer.crop(draft_len)
            for token in committed:
                fps.append(extend(fps[-1], token))
            tokens.extend(committed)
            rnd.committed = len(committed)
            if gate is not None and tally.target_passes > 1:  # a decoding round (not the prompt's prefill)
                gate.record(len(committed), time.perf_counter() - tally.round_started, session.id)
            tally.new_tokens = len(tokens) - len(req.prompt_ids)
            fresh = committed
            if finish and not hit and fresh:
                text += _release_held(decoder, holdback)
            await session.save(tokens, proposer.replica, rnd, last=bool(finish))
            if fresh:
                tally.chunk_sent()
                detail = RoundDetail(tally.target_passes, rnd.source, drafted, verdict.accepted,
                                     verdict.extra_kind, committed) if req.round_tokens else None
                logprobs = (_token_logprobs(verdict, reply.response, p, req.top_logprobs)[:len(committed)]
                            if n_logprobs else None)
                replicas = ("", "") if sent else (
                    session.target.address, proposer.replica.address if proposer.replica is not None else "")
                yield ChunkEvent(text=text, token_ids=fresh, start_index=len(tokens) - len(fresh),
                                 session_id="" if sent else session.id, round=detail, logprobs=logprobs,
                                 replicas=replicas)
                sent += 1
            tally.close_round(rnd)  # the round ends once its chunk is on the stream
            if len(tally.rounds) > 1:  # a chunk gap (the first round is the time to first token)
                config.admission.observe_round(config.router, session.target.address, rnd.total_ms)
            trace.round_closed(rnd)
    except BaseException as exc:
        if prefetch is not None and not prefetch.done():
            prefetch.cancel()
        if gate is not None:
            gate.leave()
        trace.abort(exc)
        # A client that went away (cancellation) or any failure mid-stream: the
        # record keeps the last committed state; a single-turn session's KV goes.
        proposer.close()  # parallel mode: no pre-draft outlives the request
        await asyncio.shield(session.abandon(proposer.replica))
        raise
    if not tally.rounds:  # the delivered tokens had ended the turn (a resume after its last chunk)
        await session.save(tokens, proposer.replica, RoundTally(), last=True)
    if gate is not None:
        gate.leave()
    tally.finish_reason = finish
    if not session.multi_turn:
        tally.session_id = ""  # deleted: nothing to continue
    elif proposer.features is not None:  # the next turn here starts with the held prefix's features
        config.relays.keep(session.id, proposer.features, fps)
    proposer.close()
    tally.proposer, tally.fallback_reason = proposer.name, proposer.fallback_reason
    tally.finish()
    trace.finish()
    yield tally


async def _score(target: SessionReplica, ctx: DraftContext, drafted: list[int], wait_s: float,
                 masks: RoundMasks | None = None, logprobs: int = 0, features: int = 0) -> Reply:
    """Step 2: one target pass over the committed tokens it lacks, then the drafted ones.

    With a grammar, the masks of the k + 1 scored positions go along; with
    logprobs, the target returns the log-probabilities of those positions.
    """
    allowed = (common_pb2.TokenMasks(rows=len(masks.words), bits=masks.words.astype("<i4").tobytes())
               if masks is not None else None)

    def send(client: ModelClient, position: int):
        return client.score(model_pb2.ScoreRequest(
            session_id=ctx.session_id, cache_position=position, prefix_hash=ctx.prefix_fps[position],
            tokens=[*ctx.tokens[position:], *drafted], k=len(drafted),
            sampling=ctx.sampling.message, output_mode=ctx.sampling.output_mode,
            allowed=allowed, logprobs=logprobs, features=features, seed=ctx.seed,
        ))

    reply = await target.call(send, len(ctx.tokens), wait_s=wait_s, extra=len(drafted))
    if logprobs and not reply.response.HasField("logprobs"):
        raise FailedPrecondition(f"logprobs: target replica {target.address} does not return "
                                 "log-probabilities (an older service)")
    if ctx.sampling.coupled and len(reply.response.sampled_ids) != len(drafted) + 1:
        raise FailedPrecondition(f"sampling: target replica {target.address} returns no coupled draws "
                                 "(an older service)")
    if features and not reply.response.HasField("features"):
        raise FailedPrecondition(f"features: target replica {target.address} returns no features "
                                 "(an older service), which the feature draft needs")
    return reply


def _draft_q(proposal: Proposal, own: int, masks: RoundMasks | None,
             p: torch.Tensor | None) -> torch.Tensor | None:
    """q of the scored drafts: the proposer's rows, then one-hot rows for grammar-forced tokens."""
    if p is None or proposal.probs is None:
        return None  # greedy, or a deterministic proposal: one-hot q throughout
    q = proposal.probs[:own]
    if masks is not None and masks.forced:
        onehot = torch.zeros(len(masks.forced), q.shape[-1], dtype=q.dtype)
        onehot[torch.arange(len(masks.forced)), torch.tensor(masks.forced)] = 1.0
        q = torch.cat([q, onehot])
    return q


def _verify(ctx: DraftContext, drafted: list[int], q: torch.Tensor | None,
            response: model_pb2.ScoreResponse, p: torch.Tensor | None) -> Verdict:
    """Step 3: greedy on the target's argmax ids, coupled on its draws, else exact rejection
    sampling on p and q."""
    if ctx.sampling.params.greedy:
        return verify_greedy(drafted, list(response.argmax_ids))
    if ctx.sampling.coupled:
        return verify_coupled(drafted, list(response.sampled_ids))
    return verify_sampled(drafted, q, p, seed=ctx.seed, position=len(ctx.tokens))


def _token_logprobs(verdict: Verdict, response: model_pb2.ScoreResponse, p: torch.Tensor | None,
                    top: int) -> list[TokenLogprob]:
    """The log-probability of each of the round's tokens, from the target's own Logprobs.

    Accepted drafts have theirs in Logprobs.drafted. The extra token is the
    argmax when greedy (Logprobs.argmax), the target's own draw when coupled
    (Logprobs.sampled); drawn by the verifier from p (or the residual), it is
    read from p itself, the very distribution the target's log-probabilities
    are taken from.
    """
    lp = response.logprobs
    n = lp.top_n
    out = []
    for j, token in enumerate(verdict.tokens):
        if j < verdict.accepted:
            value = lp.drafted[j]
        elif len(lp.sampled) > j:
            value = lp.sampled[j]
        elif p is None:
            value = lp.argmax[j]
        else:
            mass = float(p[j, token])
            value = math.log(mass) if mass > 0 else float("-inf")
        out.append(TokenLogprob(token, value, list(lp.top_ids[j * n:j * n + top]),
                                list(lp.top_logprobs[j * n:j * n + top])))
    return out


def _adaptive_k(policy: GoodputPolicy, config: LoopConfig, target: SessionReplica,
                proposer: Proposer, k_max: int) -> int:
    """This round's k: the best goodput (committed tokens per second for the replica) under load.

    Decided here, in the orchestrator, because only it sees both halves: the
    session's acceptance by position (it verifies) and both services' costs
    (config.costs, learned from every call's ServerTiming: the target's verify
    cost by tokens per forward and its current batch rows, the draft's step
    cost). Each service sees only its own batch. k = 0 where drafting does
    not pay (a compute-bound, loaded target); a session at k = 0 still drafts
    a little every few rounds so it can return (specdec.core.speedup.GoodputPolicy).
    """
    draft = proposer.replica.address if proposer.replica is not None else None
    policy.pooled = config.costs.acceptance(draft) if draft else None  # the draft replica's sessions so far
    return policy.choose(config.costs.round_costs(target.address, draft), k_max)


def _observe_costs(config: LoopConfig, target: SessionReplica, proposer: Proposer, proposal: Proposal,
                   reply: Reply, drafted: int) -> None:
    """Every session's calls teach the per-replica cost table (orchestrator.policy.costs) what forwards cost."""
    config.costs.observe("target", target.address, reply.call, session=target.session_id)
    if proposal.call is not None and proposer.replica is not None:
        config.costs.observe("draft", proposer.replica.address, proposal.call, drafted)


def _detokenize(
    committed: list[int], decoder: IncrementalDecoder, holdback: StopStringHoldback | None
) -> tuple[str, list[int], bool]:
    """Text for newly committed tokens; with stop strings, cut after the token completing one."""
    if holdback is None:
        return decoder.push(committed), committed, False
    text = ""
    for i, token in enumerate(committed):
        piece, hit = holdback.push(decoder.push([token]))
        text += piece
        if hit:
            return text, committed[: i + 1], True
    return text, committed, False


def _replay_delivered(req: TurnRequest, config: LoopConfig, delivered: list[int], decoder: IncrementalDecoder,
                      holdback: StopStringHoldback | None, matcher) -> str | None:
    """A resume: the client's tokens go through the decoder, the hold-back and the grammar as if
    just committed (their text was streamed before). The turn's finish reason if they end it."""
    if not delivered:
        return None
    if matcher is not None:
        try:
            matcher.commit(delivered)
        except InvalidArgument:
            raise InvalidArgument("delivered: the tokens do not follow the request's constraint") from None
    _, kept, hit = _detokenize(delivered, decoder, holdback)
    if hit:
        if len(kept) < len(delivered):
            raise InvalidArgument("delivered: tokens after the one completing a stop string")
        return STOP
    kept, finish = clip_to_stop(delivered, eos_ids=() if req.ignore_eos else config.eos_ids,
                                remaining=req.max_new_tokens)
    if len(kept) < len(delivered):
        raise InvalidArgument("delivered: tokens after the end of the turn (an EOS, or max_new_tokens)")
    return finish


def _release_held(decoder: IncrementalDecoder, holdback: StopStringHoldback | None) -> str:
    """At a finish without a stop hit: the decoder's and the hold-back's remaining text."""
    tail = decoder.flush()
    if holdback is None:
        return tail
    piece, hit = holdback.push(tail)
    return piece if hit else piece + holdback.flush()

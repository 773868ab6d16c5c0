"""The steps of one round, each a function of the turn and the typed results of the steps before it
(orchestrator.round.state):

  plan     -> Drafting      the drafting policy decides k (orchestrator.policy.drafting)
  propose  -> Drafts        the proposer drafts d_1..d_k (and q); hooks may cut the drafts
  score    -> Scores        one target forward over the uncached tokens and the drafts
  verify   -> Verdict       specdec.core.verify.verify_round: accept d_1..d_m, plus one
                            recovered or bonus token
  commit   -> RoundOutcome  cut at EOS / max_new_tokens / stop string; the target's cache
                            bookkeeping, the proposer's own (Proposer.commit), the session's
                            record (Redis)
  chunk    -> ChunkEvent    what the round streams
  close                     the outcome goes to the turn's observers (orchestrator.round.observers)
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import torch

from orchestrator.common.events import ChunkEvent, RoundDetail
from orchestrator.common.stats import RoundTally
from orchestrator.fleet.remote import ModelClient
from orchestrator.policy.drafting import Drafting
from orchestrator.proposers.base import Committed, Proposal
from orchestrator.round.state import Commit, Drafts, RoundOutcome, Scores, Turn
from specdec.core.kv import crop_lengths
from specdec.core.stopping import STOP, clip_to_stop
from specdec.core.verify import TargetScores, Verdict, verify_round
from specdec.runtime.errors import FailedPrecondition
from specdec.runtime.wire import decode_probs
from specdec.v1 import model_pb2

# finish_reason of a turn stopped by TurnRequest.max_target_passes.
PASSES = "passes"
# RoundTokens.source of a round whose drafts are all grammar-forced (orchestrator.common.grammar).
GRAMMAR = "grammar"


def plan(turn: Turn) -> Drafting:
    """Step 0: the round's drafting."""
    drafting = turn.policy.decide(turn.session.target, turn.remaining, first_round=not turn.tally.target_passes)
    if drafting.prefetch and turn.proposer.lags(turn.context(drafting)):
        # A new prompt: the draft is fed it while the target scores it (its first-round drafts
        # would cost the draft's prefill before the target's); drafting starts next round.
        drafting = replace(drafting, draft_off=True)
        turn.prefetch = asyncio.ensure_future(turn.proposer.prefetch(turn.context(drafting)))
    return drafting


async def propose(turn: Turn, drafting: Drafting) -> Drafts:
    """Step 1: the proposer drafts (it recovers from its own failures); hooks may cut the drafts."""
    ctx = turn.context(drafting)
    with turn.trace.step("propose"):
        proposal = await turn.proposer.propose(ctx)
    tokens = list(proposal.tokens) if proposal.parents is not None else proposal.tokens[:drafting.k]
    drafts = Drafts(ctx, proposal, tokens, own=len(tokens))
    for hook in turn.hooks:
        drafts = hook.drafted(turn, drafts)
    source = ((proposal.source or turn.proposer.name) if drafts.own else GRAMMAR) if drafts.tokens else ""
    if source != drafts.source:  # a plain round (nothing drafted) keeps its Drafts as they are
        drafts = replace(drafts, source=source)
    turn.tally.draft_calls += proposal.call is not None
    replica = turn.proposer.replica
    if proposal.call is None and replica is not None:
        # No draft call this round: the draft's batch calls need not wait for this session.
        replica.client.leave(replica.session_id)
    return drafts


async def score(turn: Turn, drafts: Drafts) -> Scores:
    """Step 2: one target pass over the committed tokens it lacks, then the drafted ones."""
    for hook in turn.hooks:
        hook.before_score(turn, drafts)
    fields = {name: value for hook in turn.hooks for name, value in hook.score_fields(turn, drafts).items()}
    ctx, drafted, target = drafts.ctx, drafts.tokens, turn.session.target
    if drafts.tree:
        fields["parents"] = drafts.proposal.parents

    def send(client: ModelClient, position: int):
        return client.score(model_pb2.ScoreRequest(
            session_id=ctx.session_id, cache_position=position, prefix_hash=ctx.prefix_fps[position],
            tokens=[*ctx.tokens[position:], *drafted], k=len(drafted), sampling=ctx.sampling.message,
            output_mode=ctx.sampling.output_mode, seed=ctx.seed, tenant=ctx.tenant, **fields))

    with turn.trace.step("score"):
        reply = await target.call(send, len(ctx.tokens), wait_s=turn.config.target_wait_s, extra=len(drafted))
    response = reply.response
    if ctx.sampling.coupled and len(response.sampled_ids) != len(drafted) + 1:
        raise FailedPrecondition(f"sampling: target replica {target.address} returns no coupled draws "
                                 "(an older service)")
    if drafts.tree and not response.tree:
        raise FailedPrecondition(f"parents: target replica {target.address} does not verify token trees "
                                 "(an older service)")
    greedy, coupled = ctx.sampling.params.greedy, ctx.sampling.coupled
    by_rejection = not (greedy or coupled)  # verified on p: decoded once, here
    scores = Scores(reply, TargetScores(greedy, coupled, response.argmax_ids, response.sampled_ids,
                                        decode_probs(response.probs) if by_rejection else None))
    for hook in turn.hooks:
        hook.scored(turn, drafts, scores)
    turn.tally.target_passes += 1
    return scores


def verify(turn: Turn, drafts: Drafts, scores: Scores) -> Verdict:
    """Step 3: greedy on the target's argmax ids, coupled on its draws, else exact rejection
    sampling on p and q (specdec.core.verify.verify_round picks the mode)."""
    with turn.trace.step("verify"):
        return verify_round(drafts.tokens, scores.target, parents=drafts.proposal.parents,
                            draft_probs=_draft_q(drafts), seed=drafts.ctx.seed, position=len(drafts.ctx.tokens))


def _draft_q(drafts: Drafts) -> torch.Tensor | None:
    """q of the scored drafts: the proposer's rows, then one-hot rows for grammar-forced tokens."""
    if drafts.proposal.probs is None:
        return None  # a deterministic proposal: one-hot q throughout
    q = drafts.proposal.probs[: drafts.own]
    forced = drafts.masks.forced if drafts.masks is not None else []
    if forced:
        onehot = torch.zeros(len(forced), q.shape[-1], dtype=q.dtype)
        onehot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        q = torch.cat([q, onehot])
    return q


async def commit(turn: Turn, drafting: Drafting, drafts: Drafts, scores: Scores, verdict: Verdict) -> RoundOutcome:
    """Step 4: cut at EOS / length / stop string; both caches' bookkeeping, the record."""
    req, tally = turn.req, turn.tally
    cut, finish = clip_to_stop(verdict.tokens, eos_ids=() if req.ignore_eos else turn.config.eos_ids,
                               remaining=turn.remaining)
    text, committed, stop_hit = turn.out.push(cut)
    finish = STOP if stop_hit else finish
    if not finish and req.max_target_passes and tally.target_passes >= req.max_target_passes:
        finish = PASSES  # a pass budget (the playground's quota): no further forward
    if finish and not stop_hit and committed:
        text += turn.out.release()
    done = Commit(len(turn.tokens), committed, text, stop_hit, finish, time.perf_counter() - tally.round_started)
    outcome = RoundOutcome(drafting, drafts, scores, verdict, done, _figures(drafting, drafts, scores, verdict, done))
    for hook in turn.hooks:
        hook.committed(turn, outcome)
    turn.session.target.held, _ = crop_lengths(
        committed_before=done.before, n_drafted=len(drafts.tokens), n_accepted=verdict.accepted,
        draft_held=0, n_committed=len(committed))
    turn.extend(committed)
    turn.proposer.commit(Committed(_settled(turn, drafts.proposal), len(drafts.tokens), drafts.own, verdict,
                                   turn.tokens, len(committed)))
    turn.finish = finish
    await turn.session.save(turn.tokens, turn.proposer.replica, outcome.tally, last=bool(finish))
    return outcome


def _settled(turn: Turn, proposal: Proposal) -> Proposal:
    """A first round's feed of the draft: the proposal as of what the draft holds now; a feed still
    running goes on, and the next Propose waits for it (the chunk does not)."""
    if turn.prefetch is None:
        return proposal
    feed, turn.prefetch = turn.prefetch, None
    if not feed.done():
        turn.proposer.keep_feeding(feed)
        return proposal
    held = feed.result()
    return proposal if held is None else replace(proposal, cache_length=held)  # it holds the scored prefix


def _figures(drafting: Drafting, drafts: Drafts, scores: Scores, verdict: Verdict, done: Commit) -> RoundTally:
    """The round's figures (Stats.Round) as of its commit: its calls, drafts and verdict."""
    figures = RoundTally(k=drafting.k, drafted=len(drafts.tokens), accepted=verdict.accepted,
                         committed=len(done.tokens), source=drafts.source, tree=drafts.tree,
                         accepted_ranks=list(getattr(verdict, "ranks", ())))
    figures.add_proposal(drafts.proposal)  # its draft call, or the pre-draft it used (parallel)
    reply = scores.reply
    figures.add_call(reply.call, "target", reply.cache_misses, reply.deadline_misses)
    return figures


def chunk(turn: Turn, outcome: RoundOutcome) -> ChunkEvent | None:
    """Step 5: what the round streams (None: it committed nothing)."""
    done, verdict = outcome.commit, outcome.verdict
    if not done.tokens:
        return None
    turn.tally.chunk_sent()
    first = turn.sent == 0
    detail = RoundDetail(turn.tally.target_passes, outcome.drafts.source, outcome.drafts.tokens, verdict.accepted,
                         verdict.extra_kind, done.tokens) if turn.req.round_tokens else None
    replica = turn.proposer.replica
    replicas = (turn.session.target.address, replica.address if replica is not None else "") if first else ("", "")
    turn.sent += 1
    return ChunkEvent(text=done.text, token_ids=done.tokens, start_index=len(turn.tokens) - len(done.tokens),
                      session_id=turn.session.id if first else "", round=detail,
                      logprobs=turn.logprobs.tokens(outcome) if turn.logprobs is not None else None,
                      replicas=replicas)


def close(turn: Turn, outcome: RoundOutcome) -> None:
    """The round ends once its chunk is on the stream: its outcome goes to every observer."""
    for observer in turn.observers:
        observer.round_closed(turn, outcome)

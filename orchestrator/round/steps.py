"""The steps of one round, each a function of the turn and the round's state (orchestrator.round.state).

  plan     the drafting policy decides k (orchestrator.policy.drafting)
  propose  the proposer drafts d_1..d_k (and q); hooks may cut the drafts
  score    one target forward over the uncached tokens and the drafts
  verify   specdec.core.verify: accept d_1..d_m, plus one recovered or bonus token
  commit   cut at EOS / max_new_tokens / stop string, crop both caches' bookkeeping,
           save the session (Redis), and the chunk to stream
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import torch

from orchestrator.fleet.remote import ModelClient
from orchestrator.proposers.base import DraftContext
from orchestrator.common.events import ChunkEvent, RoundDetail
from orchestrator.round.state import Round, Turn
from orchestrator.common.stats import RoundTally
from specdec.core.kv import crop_lengths
from specdec.core.stopping import STOP, clip_to_stop
from specdec.core.verify import (Verdict, node_depths, verify_coupled, verify_greedy, verify_sampled,
                                 verify_tree, verify_tree_sampled)
from specdec.runtime.errors import FailedPrecondition
from specdec.runtime.wire import decode_probs
from specdec.v1 import model_pb2

# finish_reason of a turn stopped by TurnRequest.max_target_passes.
PASSES = "passes"
# RoundTokens.source of a round whose drafts are all grammar-forced (orchestrator.common.grammar).
GRAMMAR = "grammar"


def plan(turn: Turn) -> Round:
    """Step 0: the round's drafting and what the proposer may look at."""
    rnd = Round(RoundTally(), remaining=turn.remaining)
    rnd.drafting = turn.policy.decide(turn.session.target, rnd.remaining, first_round=not turn.tally.target_passes)
    rnd.tally.k = rnd.drafting.k
    rnd.ctx = DraftContext(turn.session.id, turn.tokens, turn.fps, len(turn.req.prompt_ids), rnd.tally.k,
                           turn.sampling, turn.tally.seed, away=turn.away, draft_off=rnd.drafting.draft_off,
                           tree_nodes=rnd.drafting.tree_nodes, tree_width=rnd.drafting.tree_width,
                           tenant=turn.req.tenant)
    if rnd.drafting.prefetch and turn.proposer.lags(rnd.ctx):
        # A new prompt: the draft is fed it while the target scores it (its first-round drafts
        # would cost the draft's prefill before the target's); drafting starts next round.
        rnd.ctx = replace(rnd.ctx, draft_off=True)
        turn.prefetch = asyncio.ensure_future(turn.proposer.prefetch(rnd.ctx))
    return rnd


async def propose(turn: Turn, rnd: Round) -> None:
    """Step 1: the proposer drafts (it recovers from its own failures); hooks may cut the drafts."""
    with turn.trace.step("propose"):
        rnd.proposal = await turn.proposer.propose(rnd.ctx)
    tree = rnd.proposal.parents is not None
    rnd.drafted = list(rnd.proposal.tokens) if tree else rnd.proposal.tokens[: rnd.tally.k]
    rnd.own = len(rnd.drafted)
    rnd.tally.tree = tree
    for hook in turn.hooks:
        hook.drafted(turn, rnd)
    source = rnd.proposal.source or turn.proposer.name
    rnd.tally.source = (source if rnd.own else GRAMMAR) if rnd.drafted else ""
    turn.tally.draft_calls += rnd.proposal.call is not None
    replica = turn.proposer.replica
    if rnd.proposal.call is None and replica is not None:
        # No draft call this round: the draft's batch calls need not wait for this session.
        replica.client.leave(replica.session_id)
    rnd.tally.add_proposal(rnd.proposal)  # its draft call, or the pre-draft it used (parallel)


async def score(turn: Turn, rnd: Round) -> None:
    """Step 2: one target pass over the committed tokens it lacks, then the drafted ones."""
    for hook in turn.hooks:
        hook.before_score(turn, rnd)
    fields = {name: value for hook in turn.hooks for name, value in hook.score_fields(turn, rnd).items()}
    ctx, drafted, target = rnd.ctx, rnd.drafted, turn.session.target
    if rnd.tally.tree:
        fields["parents"] = rnd.proposal.parents

    def send(client: ModelClient, position: int):
        return client.score(model_pb2.ScoreRequest(
            session_id=ctx.session_id, cache_position=position, prefix_hash=ctx.prefix_fps[position],
            tokens=[*ctx.tokens[position:], *drafted], k=len(drafted), sampling=ctx.sampling.message,
            output_mode=ctx.sampling.output_mode, seed=ctx.seed, tenant=ctx.tenant, **fields))

    with turn.trace.step("score"):
        rnd.reply = await target.call(send, len(ctx.tokens), wait_s=turn.config.target_wait_s, extra=len(drafted))
    if ctx.sampling.coupled and len(rnd.reply.response.sampled_ids) != len(drafted) + 1:
        raise FailedPrecondition(f"sampling: target replica {target.address} returns no coupled draws "
                                 "(an older service)")
    if rnd.tally.tree and not rnd.reply.response.tree:
        raise FailedPrecondition(f"parents: target replica {target.address} does not verify token trees "
                                 "(an older service)")
    for hook in turn.hooks:
        hook.scored(turn, rnd)
    turn.tally.target_passes += 1
    _settle_prefetch(turn, rnd)
    reply = rnd.reply
    rnd.tally.add_call(reply.call, "target", reply.cache_misses, reply.deadline_misses)
    turn.policy.learn(target, rnd.proposal.call, reply, len(drafted))


def _settle_prefetch(turn: Turn, rnd: Round) -> None:
    """A first round's feed of the draft: what it holds now, or, still running, the next Propose
    waits for it (the chunk does not)."""
    if turn.prefetch is None:
        return
    if turn.prefetch.done():
        held = turn.prefetch.result()
        if held is not None:  # the draft now holds the scored prefix
            rnd.proposal = replace(rnd.proposal, cache_length=held)
    else:
        turn.proposer.keep_feeding(turn.prefetch)
    turn.prefetch = None


def verify(turn: Turn, rnd: Round) -> None:
    """Step 3: greedy on the target's argmax ids, coupled on its draws, else exact rejection
    sampling on p and q; the policy and the proposer learn what the proposer got right."""
    sampling, response = rnd.ctx.sampling, rnd.reply.response
    with turn.trace.step("verify"):
        if rnd.tally.tree and (sampling.params.greedy or sampling.coupled):  # the target's own tokens
            own = response.argmax_ids if sampling.params.greedy else response.sampled_ids
            rnd.verdict = verify_tree(rnd.drafted, rnd.proposal.parents, list(own))
        elif rnd.tally.tree:  # recursive rejection over siblings, on p per node
            rnd.p = decode_probs(response.probs)
            rnd.verdict = verify_tree_sampled(rnd.drafted, rnd.proposal.parents, rnd.p, seed=rnd.ctx.seed,
                                              position=len(rnd.ctx.tokens))
        elif sampling.params.greedy:
            rnd.verdict = verify_greedy(rnd.drafted, list(response.argmax_ids))
        elif sampling.coupled:
            rnd.verdict = verify_coupled(rnd.drafted, list(response.sampled_ids))
        else:
            rnd.p = decode_probs(response.probs)
            rnd.verdict = verify_sampled(rnd.drafted, _draft_q(rnd), rnd.p, seed=rnd.ctx.seed,
                                         position=len(rnd.ctx.tokens))
    verdict: Verdict = rnd.verdict
    depth = max(node_depths(rnd.proposal.parents), default=0) if rnd.tally.tree else None
    turn.tally.add_verdict(len(rnd.drafted), verdict, depth)
    rnd.tally.drafted, rnd.tally.accepted = len(rnd.drafted), verdict.accepted
    rnd.tally.accepted_ranks = list(getattr(verdict, "ranks", ()))
    own_accepted = min(verdict.accepted, rnd.own)  # what the proposer itself got right
    turn.policy.observe(rnd.own, own_accepted)
    turn.proposer.observe(rnd.own, own_accepted)


def _draft_q(rnd: Round) -> torch.Tensor | None:
    """q of the scored drafts: the proposer's rows, then one-hot rows for grammar-forced tokens."""
    if rnd.proposal.probs is None:
        return None  # a deterministic proposal: one-hot q throughout
    q = rnd.proposal.probs[: rnd.own]
    forced = rnd.masks.forced if rnd.masks is not None else []
    if forced:
        onehot = torch.zeros(len(forced), q.shape[-1], dtype=q.dtype)
        onehot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        q = torch.cat([q, onehot])
    return q


async def commit(turn: Turn, rnd: Round) -> ChunkEvent | None:
    """Step 4: cut at EOS / length / stop string; cache bookkeeping, the record, the chunk."""
    req, tally = turn.req, turn.tally
    committed, finish = clip_to_stop(rnd.verdict.tokens, eos_ids=() if req.ignore_eos else turn.config.eos_ids,
                                     remaining=rnd.remaining)
    rnd.text, rnd.committed, rnd.stop_hit = turn.out.push(committed)
    finish = STOP if rnd.stop_hit else finish
    for hook in turn.hooks:
        hook.committed(turn, rnd)
    if not finish and req.max_target_passes and tally.target_passes >= req.max_target_passes:
        finish = PASSES  # a pass budget (the playground's quota): no further forward
    _crop(turn, rnd)
    turn.extend(rnd.committed)
    turn.proposer.committed(turn.tokens)
    rnd.tally.committed = len(rnd.committed)
    if tally.target_passes > 1:  # a decoding round (not the prompt's prefill) for the gate
        turn.policy.record(len(rnd.committed), time.perf_counter() - tally.round_started, turn.session.id)
    if finish and not rnd.stop_hit and rnd.committed:
        rnd.text += turn.out.release()
    turn.finish = finish
    await turn.session.save(turn.tokens, turn.proposer.replica, rnd.tally, last=bool(finish))
    return _chunk(turn, rnd) if rnd.committed else None


def _crop(turn: Turn, rnd: Round) -> None:
    """Both caches' bookkeeping after the verdict: what each service holds of the committed tokens."""
    before, proposal = len(turn.tokens), rnd.proposal
    if rnd.tally.tree:  # the draft takes up the accepted path as far as it fed it (engine.tree)
        # A free guess's tree (lookup, suffix) holds no `held`: the draft fed none of it.
        held = proposal.held or ()
        draft_held = proposal.cache_length + sum(1 for _ in _held_prefix(rnd.verdict.path, held))
    # The draft's own cache holds its tokens, not grammar-forced ones after them.
    elif rnd.own < len(rnd.drafted):
        draft_held = min(proposal.cache_length, before + rnd.own)
    else:
        draft_held = proposal.cache_length
    turn.session.target.held, draft_len = crop_lengths(
        committed_before=before, n_drafted=len(rnd.drafted), n_accepted=rnd.verdict.accepted,
        draft_held=draft_held, n_committed=len(rnd.committed))
    turn.proposer.crop(draft_len)


def _held_prefix(path, held):
    """The accepted path's nodes from depth 1 down while the draft holds them."""
    for node in path:
        if node >= len(held) or not held[node]:
            return
        yield node


def _chunk(turn: Turn, rnd: Round) -> ChunkEvent:
    turn.tally.chunk_sent()
    verdict, first = rnd.verdict, turn.sent == 0
    detail = RoundDetail(turn.tally.target_passes, rnd.tally.source, rnd.drafted, verdict.accepted,
                         verdict.extra_kind, rnd.committed) if turn.req.round_tokens else None
    replica = turn.proposer.replica
    replicas = (turn.session.target.address, replica.address if replica is not None else "") if first else ("", "")
    turn.sent += 1
    return ChunkEvent(text=rnd.text, token_ids=rnd.committed, start_index=len(turn.tokens) - len(rnd.committed),
                      session_id=turn.session.id if first else "", round=detail,
                      logprobs=turn.logprobs.tokens(rnd) if turn.logprobs is not None else None,
                      replicas=replicas)


def close(turn: Turn, rnd: Round) -> None:
    """The round ends once its chunk is on the stream."""
    turn.tally.close_round(rnd.tally)
    if len(turn.tally.rounds) > 1:  # a chunk gap (the first round is the time to first token)
        turn.config.admission.observe_round(turn.config.router, turn.session.target.address, rnd.tally.total_ms)
    turn.trace.round_closed(rnd.tally)

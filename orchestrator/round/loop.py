"""The speculative decoding loop: propose, score, verify, commit, one round at a time.

`generate(req, config)` is an async generator of `ChunkEvent`s and a final
`Tally`. A turn opens its session (orchestrator.round.sessions: the Redis
record, a slot on a target replica) and its proposer, then runs rounds, each
the steps of orchestrator.round.steps, each step passing its typed result on
(orchestrator.round.state):

  0. plan     the drafting policy decides k                        -> Drafting
  1. propose  the proposer drafts d_1..d_k (and q)                 -> Drafts
  2. score    one target forward over the uncached committed
              tokens + the drafts                                  -> Scores
  3. verify   accept d_1..d_m, plus one recovered or bonus token   -> Verdict
  4. commit   cut at EOS / max_new_tokens / stop string, both
              caches' bookkeeping, save the session (one Redis
              write)                                               -> RoundOutcome
  5. stream the round's chunk; the outcome goes to the turn's observers
     (orchestrator.round.observers)

A cache miss from either service resends every committed token from position 0
(the text cannot change: the tokens are the same); a dead replica is replaced
(orchestrator.fleet.remote.SessionReplica); the proposer handles its own failures.

A resume (`resume_from`, after the stream's orchestrator died) continues the
turn from the tokens the client received (`Session.prefix`): they are
replayed through the text output and the grammar (their text was streamed
before), and the rounds draft after them. Each chunk carries the absolute index
of its first token.

Sampling (specdec.core.verify): a request with `coupled` set (every seeded one,
by default) verifies by the coupled sampler, so its text is target-only
decoding's for its seed whatever was drafted; the others by rejection sampling.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from orchestrator.config import LoopConfig
from orchestrator.common.kinds import PREDICTED_OUTPUT
from orchestrator.policy.drafting import DraftingPolicy
from orchestrator.proposers.factory import open_proposer
from orchestrator.common.request import TurnRequest, WireSampling
from orchestrator.round import steps
from orchestrator.common.events import ChunkEvent
from orchestrator.round.hooks import FeatureHook, GrammarHook, LogprobsHook, MinTokensHook
from orchestrator.round.observers import observers
from orchestrator.round.output import TextOut
from orchestrator.round.sessions import Session, open_session
from orchestrator.round.state import Turn
from orchestrator.common.stats import RoundTally, Tally, Timer
from specdec.core.fingerprint import prefix_fingerprints
from specdec.runtime import tracing


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
    turn = await _open_turn(req, config, session, tally, trace)
    try:
        while not turn.finish:
            drafting = steps.plan(turn)
            drafts = await steps.propose(turn, drafting)
            scores = await steps.score(turn, drafts)
            verdict = steps.verify(turn, drafts, scores)
            outcome = await steps.commit(turn, drafting, drafts, scores, verdict)
            chunk = steps.chunk(turn, outcome)
            if chunk is not None:
                yield chunk
            steps.close(turn, outcome)
    except BaseException as exc:
        await _abort(turn, exc)
        raise
    yield await _finish(turn)


async def _open_turn(req: TurnRequest, config: LoopConfig, session: Session, tally: Tally, trace) -> Turn:
    """The turn's proposer, drafting policy, hooks and text output; a resume's tokens replayed."""
    with Timer(tally, "redis_ms"):  # routing reads the registry
        proposer = await open_proposer(req, config, session.id, session.draft_home(),
                                       target=lambda: session.target.address)
    policy = DraftingPolicy(config.costs, proposer, request_k=req.k, default_k=config.default_k,
                            max_k=config.max_k, adaptive_k=config.adaptive_k,
                            gate=config.speculation_gate and req.proposer != PREDICTED_OUTPUT,
                            tree=_tree_shape(config, proposer))
    tokens = list(session.prefix)  # the prompt, then (a resume) the tokens the client has
    # Compiled once per request off the loop (orchestrator.api.bounds); a copy of it per turn.
    compiled = req.grammar or (config.grammars.compile(req.constraint) if req.constraint is not None else None)
    grammar = GrammarHook(compiled.matcher()) if compiled is not None else None
    logprobs = LogprobsHook(req.top_logprobs) if req.logprobs else None
    out = TextOut(config.tokenizer, req.prompt_ids, req.stop, eos_ids=() if req.ignore_eos else config.eos_ids,
                  stop_ids=req.stop_token_ids, keep_special=req.keep_special_tokens,
                  include_stop=req.include_stop_str_in_output)
    # The minimum's mask goes into the grammar's (which its hook sends), so it comes after it.
    minimum = MinTokensHook(req.min_tokens, out.end_ids, config.grammars.vocab_size) \
        if req.min_tokens and out.end_ids else None
    hooks = tuple(h for h in (grammar, minimum, FeatureHook(), logprobs) if h is not None)
    turn = Turn(req, config, session, tally, trace, proposer, policy,
                WireSampling.encode(req.sampling, coupled=req.coupled),  # once per request, not per RPC
                tokens, prefix_fingerprints(tokens), out, hooks, observers(), logprobs)
    delivered = tokens[len(req.prompt_ids):]
    if grammar is not None and delivered:
        grammar.replay(delivered)
    turn.finish = turn.out.replay(delivered, max_new_tokens=req.max_new_tokens)
    tally.new_tokens = len(delivered)
    return turn


def _tree_shape(config: LoopConfig, proposer) -> tuple[int, int]:
    """(tree nodes, width) for a turn that may draft token trees, else (0, 0): a proposer that
    branches. A grammar's masks, min_tokens and log-probabilities are per node
    (orchestrator.common.grammar.TurnMatcher.tree_masks, orchestrator.round.hooks). Greedy and
    coupled trees are verified by the target's own tokens, others by recursive rejection over
    siblings (specdec.core.verify.verify_tree_sampled)."""
    ok = config.tree_nodes > 0 and proposer.branches
    return (config.tree_nodes, config.tree_width) if ok else (0, 0)


async def _abort(turn: Turn, exc: BaseException) -> None:
    """A client that went away (cancellation) or any failure mid-stream: the record keeps the last
    committed state; a single-turn session's KV goes."""
    if turn.prefetch is not None and not turn.prefetch.done():
        turn.prefetch.cancel()
    turn.policy.close()
    turn.trace.abort(exc)
    turn.proposer.close()  # parallel mode: no pre-draft outlives the request
    await asyncio.shield(turn.session.abandon(turn.proposer.replica))


async def _finish(turn: Turn) -> Tally:
    tally, session, proposer = turn.tally, turn.session, turn.proposer
    if not tally.rounds:  # the delivered tokens had ended the turn (a resume after its last chunk)
        await session.save(turn.tokens, proposer.replica, RoundTally(), last=True)
    turn.policy.close()
    tally.finish_reason = turn.finish
    if not session.multi_turn:
        tally.session_id = ""  # deleted: nothing to continue
    elif proposer.features is not None:  # the next turn here starts with the held prefix's features
        turn.config.relays.keep(session.id, proposer.features, turn.fps)
    proposer.close()
    tally.proposer, tally.fallback_reason = proposer.name, proposer.fallback_reason
    tally.finish()
    turn.trace.finish()
    return tally

"""Who learns from a round: each observer gets the round's outcome once, when it is whole (its chunk
is on the stream; orchestrator.round.steps.close), in this order:

  TallyObserver      the turn's statistics: the round's figures closed (its total time), the
                     verdict's acceptance by position and by rank among siblings
  PolicyObserver     the drafting policy: both services' costs (orchestrator.policy.costs), the
                     proposer's acceptance (adaptive k), a decoding round's tokens and time (the
                     speculation gate)
  AdmissionObserver  the target replica's pace: the gap between chunks (orchestrator.policy.capacity)
  TraceObserver      the request's trace: the round's span

The proposer learns from the same round in its own `commit` (orchestrator.proposers.base), called
by the commit step: its cache bookkeeping is part of what the session's record saves.
"""
from __future__ import annotations

from orchestrator.round.state import RoundObserver, RoundOutcome, Turn
from specdec.core.verify import node_depths


class TallyObserver(RoundObserver):
    def round_closed(self, turn: Turn, outcome: RoundOutcome) -> None:
        drafts = outcome.drafts
        turn.tally.close_round(outcome.tally)  # first: the round's total time, which others read
        depth = max(node_depths(drafts.proposal.parents), default=0) if drafts.tree else None
        turn.tally.add_verdict(len(drafts.tokens), outcome.verdict, depth)


class PolicyObserver(RoundObserver):
    def round_closed(self, turn: Turn, outcome: RoundOutcome) -> None:
        drafts, policy = outcome.drafts, turn.policy
        policy.learn(turn.session.target, drafts.proposal.call, outcome.scores.reply, len(drafts.tokens))
        policy.observe(drafts.own, outcome.own_accepted)
        if turn.tally.target_passes > 1:  # a decoding round (not the prompt's prefill) for the gate
            policy.record(len(outcome.commit.tokens), outcome.commit.seconds, turn.session.id)


class AdmissionObserver(RoundObserver):
    def round_closed(self, turn: Turn, outcome: RoundOutcome) -> None:
        if len(turn.tally.rounds) > 1:  # a chunk gap (the first round is the time to first token)
            turn.config.admission.observe_round(turn.config.router, turn.session.target.address,
                                                outcome.tally.total_ms)


class TraceObserver(RoundObserver):
    def round_closed(self, turn: Turn, outcome: RoundOutcome) -> None:
        turn.trace.round_closed(outcome.tally)


def observers() -> tuple[RoundObserver, ...]:
    """Every turn's observers, in the order they learn."""
    return TallyObserver(), PolicyObserver(), AdmissionObserver(), TraceObserver()

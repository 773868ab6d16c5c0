"""Each round's drafting decision for one turn: the one place the loop asks how much to draft.

A request that names k drafts k. One that leaves k to the server drafts the
server's default k, or with `--default-k auto` the goodput model's choice
(specdec.core.speedup.GoodputPolicy: the session's acceptance by position
against the replicas' measured costs, orchestrator.policy.costs), and in both
cases only where the speculation gate (orchestrator.policy.gate) measured
drafting faster on the target replica at this load. The combined proposer then
picks lookup or the draft model within that k (orchestrator.proposers.combined).
The decision is a `Drafting`: k, and for a turn that may branch (a draft
model, greedy or the coupled sampler, no grammar or log-probabilities) a
token tree's size, k deep, from the target's verify-cost surface
(specdec.core.speedup.tree_size): as large as --tree-nodes while the verify
costs at most a quarter more than the chain's; under load, where every row's
extra tokens are paid for by all, a chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from orchestrator.fleet.remote import Call, Reply, SessionReplica
from orchestrator.policy.costs import CostBook
from orchestrator.policy.gate import SpeculationGate
from specdec.core.speedup import GoodputPolicy, tree_size


@dataclass(frozen=True)
class Drafting:
    """One round's drafting."""

    k: int  # tokens asked of the proposer (0: the round is target-only)
    # The draft model sits the round out (a plain epoch of the gate); free guesses may still propose.
    draft_off: bool = False
    # Round 1 may feed the draft the prompt alongside the target's Score instead of drafting first.
    prefetch: bool = False
    # A token tree of at most this many tokens (k deep) instead of a chain of k; 0 = a chain.
    tree_nodes: int = 0
    tree_width: int = 0


class Drafter(Protocol):
    """What the policy reads of the turn's proposer (orchestrator.proposers.base.Proposer)."""

    proposes: bool  # False: target-only, nothing to decide
    adaptive: bool  # k may be chosen per round
    replica: SessionReplica | None  # the draft replica holding the session's KV, if any
    own_length: bool  # it sets its proposal's length: k only caps it (max_k unless the request names k)
    free_guesses: bool  # a plain epoch still takes its proposals that cost no draft call
    prefetches: bool  # a first round may feed its draft the prompt beside the target's Score


class DraftingPolicy:
    """Decides each round's drafting for one turn and learns from what the round did.

    `gate`: whether the turn may be gated at all (the orchestrator's --speculation-gate, and not
    for a caller's prediction, which is asked for and costs no draft work).
    """

    def __init__(self, costs: CostBook, proposer: Drafter, *, request_k: int, default_k: int, max_k: int,
                 adaptive_k: bool, gate: bool, tree: tuple[int, int] = (0, 0)) -> None:
        self.costs, self.proposer = costs, proposer
        self.tree_nodes, self.tree_width = tree  # (0, 0): chains only
        self.adaptive = GoodputPolicy() if not request_k and adaptive_k and proposer.adaptive else None
        self.k_max = request_k or (max_k if self.adaptive is not None or proposer.own_length else default_k)
        # No k in the request: whether drafting pays on the target replica is measured by the gate.
        self.gated = not request_k and proposer.proposes and gate
        self.gate: SpeculationGate | None = None

    def decide(self, target: SessionReplica, remaining: int, first_round: bool) -> Drafting:
        """This round's drafting on `target`, with `remaining` tokens left to generate (the round's
        extra token fills the last slot)."""
        self._follow(target.address)
        if not self.proposer.proposes:
            return Drafting(0)
        draft_off = False
        if self.gate is not None and not self.gate.allows():
            # This epoch measures plain decoding (or plain decoding measured better): no draft model.
            # A lone session's proposer with free guesses keeps those that pay by themselves; under
            # load a plain epoch is target-only rounds, the gate's baseline.
            draft_off = self.proposer.free_guesses and self.gate.live <= 1
            k = self.k_max if draft_off else 0
        else:
            k = self.k_max if self.adaptive is None else self._goodput_k(target)
        k = max(0, min(k, remaining - 1))
        prefetch = (self.gated and k > 0 and not draft_off and first_round
                    and self.proposer.prefetches)
        nodes = self._tree_nodes(target, k) if k > 0 and not draft_off and self.tree_nodes > 0 else 0
        return Drafting(k, draft_off, prefetch, nodes, self.tree_width if nodes else 0)

    def _follow(self, target: str) -> None:
        """The gate of the replica the session is on (its first round, or after a move)."""
        if self.gated and self.gate is not self.costs.gate(target):
            if self.gate is not None:
                self.gate.leave()
            self.gate = self.costs.gate(target)
            self.gate.enter()

    def _goodput_k(self, target: SessionReplica) -> int:
        """The best goodput (committed tokens per second for the replica) under load.

        Decided in the orchestrator because only it sees both halves: the session's
        acceptance by position (it verifies) and both services' costs, learned from every
        call's ServerTiming. k = 0 where drafting does not pay; a session at k = 0 still
        drafts a little every few rounds so it can return.
        """
        replica = self.proposer.replica
        draft = replica.address if replica is not None else None
        self.adaptive.pooled = self.costs.acceptance(draft) if draft else None  # the draft's sessions so far
        return self.adaptive.choose(self.costs.round_costs(target.address, draft), self.k_max)

    def _tree_nodes(self, target: SessionReplica, k: int) -> int:
        """A tree's size from the target's verify-cost surface (specdec.core.speedup.tree_size)."""
        replica = self.proposer.replica
        costs = self.costs.round_costs(target.address, replica.address if replica is not None else None)
        return tree_size(costs, k, self.tree_nodes)

    def learn(self, target: SessionReplica, draft_call: Call | None, reply: Reply, drafted: int) -> None:
        """Every session's calls teach the per-replica cost table what forwards cost."""
        self.costs.observe("target", target.address, reply.call, session=target.session_id)
        replica = self.proposer.replica
        if draft_call is not None and replica is not None:
            self.costs.observe("draft", replica.address, draft_call, drafted)

    def observe(self, drafted: int, accepted: int) -> None:
        """The proposer's own drafted tokens this round and how many the target accepted."""
        if self.adaptive is not None and self.proposer.proposes:
            self.adaptive.observe(drafted, accepted)

    def record(self, committed: int, seconds: float, session: str) -> None:
        """A decoding round's tokens and time, for the gate's epoch."""
        if self.gate is not None:
            self.gate.record(committed, seconds, session)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.leave()
            self.gate = None

"""Proposers: where a round's drafted tokens come from, behind one protocol.

The loop sees only what `Proposer` declares (its defaults are a proposer that
drafts alone, with no cache and no draft model); a request's proposer comes
from its kind's home (orchestrator.proposers.registry). A
deterministic proposer (orchestrator.proposers.local: prompt lookup, the
caller's guess, a prediction, none) returns `probs=None`; the verifier then
treats its q as one-hot, which keeps sampling exact. The draft service's
proposer is orchestrator.proposers.draft.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from orchestrator.fleet.remote import Call, SessionReplica
from orchestrator.proposers.features import FeatureRelay
from orchestrator.common.request import WireSampling
from specdec.core.kv import crop_lengths
from specdec.core.verify import Verdict

@dataclass(frozen=True)
class DraftContext:
    """What a proposer may look at for one round. Read-only by contract."""

    session_id: str
    tokens: Sequence[int]  # committed ids: prompt + generated (do not mutate)
    prefix_fps: Sequence[int]  # prefix_fps[i] = fingerprint(tokens[:i])
    prompt_len: int
    k: int  # draft at most this many tokens
    sampling: WireSampling
    seed: int
    # This round goes without the draft model: it is being fed the prompt alongside the target's
    # Score (DraftServiceProposer.prefetch), or the speculation gate runs a plain epoch
    # (orchestrator.policy.gate). A free guess (prompt lookup, in the combined proposer) still may propose.
    draft_off: bool = False
    # Called just before the round waits on a draft call: the target's batch calls then stop
    # waiting for this session (it rejoins them with its Score; orchestrator.fleet.batching).
    away: Callable[[], None] | None = None
    tenant: str = ""  # the request's tenant, sent on every model call (the services' fair eviction)
    # Draft a token tree of at most this many tokens, k deep, `tree_width` candidates per node
    # (orchestrator.policy.drafting); 0 = a chain of k. Only the draft service branches.
    tree_nodes: int = 0
    tree_width: int = 0


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens d_1..d_n (n <= k) and, for a model draft when sampling, q."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [n, vocab] q; None = one-hot (deterministic)
    cache_length: int = 0  # tokens the draft replica holds after the call (0: no draft cache)
    call: Call | None = None  # the RPC, when there was one
    cache_misses: int = 0
    pre_draft: PreDraft | None = None  # parallel mode: what became of this round's pre-draft
    source: str = ""  # the combined proposer: what proposed this round ("lookup" or "draft")
    deadline_misses: int = 0  # draft calls of this round that missed their deadline
    # A token tree (the draft service's, when DraftContext.tree_nodes asked for one): each drafted
    # token's parent (-1: the last committed token; parents first), and whether the draft holds it.
    parents: list[int] | None = None
    held: list[bool] | None = None


@dataclass(frozen=True)
class PreDraft:
    """Parallel mode: a pre-draft made for this round while the target verified the last one.

    hit: its drafts are this round's proposal (no draft call on the critical path);
    else it was discarded and the round drafted anew. `call` is the pre-draft's RPC
    and `waited_ms` how long this round still waited for it (hits only).
    """

    hit: bool
    call: Call | None = None
    waited_ms: float = 0.0


@dataclass(frozen=True)
class Committed:
    """A round's end as its proposer sees it (Proposer.commit)."""

    proposal: Proposal  # what it proposed (its cache_length as of the round's end)
    drafted: int  # tokens the target scored: the proposal, cut by hooks, then grammar-forced ones
    own: int  # the proposer's own among them
    verdict: Verdict
    tokens: Sequence[int]  # the turn's committed tokens now: the prompt, then the output
    committed: int  # of them, this round's (the verdict's, after EOS / stop / length)

    @property
    def before(self) -> int:
        """The committed tokens before the round."""
        return len(self.tokens) - self.committed

    @property
    def own_accepted(self) -> int:
        """How many of its own drafted tokens the target accepted."""
        return min(self.verdict.accepted, self.own)

    def draft_keeps(self) -> int:
        """What a draft replica's cache holds of the committed tokens now: the tokens it held
        after its call (a tree: the accepted path's nodes it fed), none past the round's commit."""
        proposal, before = self.proposal, self.before
        if proposal.parents is not None:
            # A free guess's tree (lookup, suffix) holds no `held`: the draft fed none of it.
            held = proposal.held or ()
            fed = proposal.cache_length + sum(1 for _ in _held_prefix(self.verdict.path, held))
        elif self.own < self.drafted:  # its own tokens, not the grammar-forced ones after them
            fed = min(proposal.cache_length, before + self.own)
        else:
            fed = proposal.cache_length
        return crop_lengths(committed_before=before, n_drafted=self.drafted, n_accepted=self.verdict.accepted,
                            draft_held=fed, n_committed=self.committed)[1]


def _held_prefix(path, held):
    """The accepted path's nodes from depth 1 down while the draft holds them."""
    for node in path:
        if node >= len(held) or not held[node]:
            return
        yield node


class Proposer:
    """The per-request part of a proposer: everything the loop may use of it, declared here with
    its default (a proposer overrides what it does differently; the loop reads nothing else)."""

    name: str = ""  # the kind proposing now (Stats.proposer): "none" once a draft has fallen back
    fallback_reason: str = ""  # why it proposes nothing although asked to; "" otherwise
    replica: SessionReplica | None = None  # the draft replica holding the session's KV, if any
    adaptive: bool = False  # k may be chosen per round from measured acceptance and costs
    proposes: bool = True  # False: target-only, the loop asks for nothing
    branches: bool = False  # it may draft a token tree when DraftContext.tree_nodes asks
    # It sets its proposal's length itself: the round's k only caps it (max_k unless the request
    # names k; orchestrator.policy.drafting).
    own_length: bool = False
    # A plain epoch of the speculation gate still takes its proposals that cost no draft call.
    free_guesses: bool = False
    # A first round may feed the draft the prompt beside the target's Score (lags, prefetch).
    prefetches: bool = False
    # A feature draft's relay (orchestrator.proposers.features): the loop asks Score for features and
    # hands them over; None for every other proposer.
    features: FeatureRelay | None = None

    async def propose(self, ctx: DraftContext) -> Proposal:
        raise NotImplementedError

    def commit(self, done: Committed) -> None:
        """After a round's verdict and its cuts: the proposer learns what the target accepted of
        its drafts and keeps its own cache's bookkeeping (what its draft replica still holds)."""

    def close(self) -> None:
        """The request is over (finished or not): stop any work started ahead of time."""

    def lags(self, ctx: DraftContext) -> bool:
        """Whether the draft lacks enough of the context that a first round should feed it instead."""
        return False

    async def prefetch(self, ctx: DraftContext) -> int | None:
        """Feed the draft the context beside the target's Score: the tokens it then holds."""
        return None

    def keep_feeding(self, feed: asyncio.Future) -> None:
        """A prefetch still running when its round ends: the next propose waits for it."""

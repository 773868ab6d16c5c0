"""A turn's state across its rounds (`Turn`), the typed results of a round's steps (`Drafts`,
`Scores`, `Commit`, and the whole `RoundOutcome`), and the interface of the features that ride on
every round (`RoundHook`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator.config import LoopConfig
from orchestrator.fleet.remote import Reply
from orchestrator.policy.drafting import Drafting, DraftingPolicy
from orchestrator.proposers.base import DraftContext, Proposal, Proposer
from orchestrator.common.request import TurnRequest, WireSampling
from orchestrator.common.grammar import RoundMasks
from orchestrator.round.output import TextOut
from orchestrator.round.sessions import Session
from orchestrator.common.stats import RoundTally, Tally
from specdec.core.fingerprint import extend
from specdec.core.verify import TargetScores, Verdict


@dataclass(frozen=True)
class Drafts:
    """propose's result: what the target scores this round."""

    ctx: DraftContext  # what the proposer looked at
    proposal: Proposal
    tokens: list[int]  # what the target scores: the proposal, cut by hooks (a grammar)
    own: int  # the proposer's own tokens among them (the rest: grammar-forced)
    source: str = ""  # what proposed them (RoundTokens.source; "" = nothing drafted)
    masks: RoundMasks | None = None  # structured output: the grammar's masks of the scored positions

    @property
    def tree(self) -> bool:
        """A token tree (Proposal.parents), not a chain."""
        return self.proposal.parents is not None


@dataclass(frozen=True)
class Scores:
    """score's result: the target's Score reply and what verification reads of it."""

    reply: Reply  # the call: its response (log-probabilities, features), timing, misses
    target: TargetScores  # its own tokens, and p where the round is verified by rejection

    @property
    def p(self) -> torch.Tensor | None:
        """The target's distributions [drafted + 1, vocab], decoded where verification needed them."""
        return self.target.probs


@dataclass(frozen=True)
class Commit:
    """commit's cut of the verdict: what joins the turn."""

    before: int  # the turn's committed tokens before the round
    tokens: list[int]  # the verdict's tokens after EOS / stop string / length
    text: str  # their text, to stream
    stop_hit: bool  # a stop string ended the turn
    finish: str | None  # why the turn ends with this round, if it does
    seconds: float  # the round's time up to its commit (the gate's measure)


@dataclass(frozen=True)
class RoundOutcome:
    """One round, whole: each step's result, and the round's figures (`tally`, filled in as its
    record is written and its chunk is sent). Published once to the turn's observers
    (orchestrator.round.observers)."""

    drafting: Drafting
    drafts: Drafts
    scores: Scores
    verdict: Verdict
    commit: Commit
    tally: RoundTally

    @property
    def own_accepted(self) -> int:
        """How many of the proposer's own drafted tokens the target accepted."""
        return min(self.verdict.accepted, self.drafts.own)


class RoundObserver:
    """A party that learns from every round's outcome (orchestrator.round.observers)."""

    def round_closed(self, turn: Turn, outcome: RoundOutcome) -> None:
        """The round's chunk is on the stream: its outcome is whole."""


class RoundHook:
    """A feature that rides on every round (a grammar, a feature relay, log-probabilities).
    Each step calls every hook of the turn in order; these defaults do nothing."""

    def drafted(self, turn: Turn, drafts: Drafts) -> Drafts:
        """After propose: may cut the drafts (and their `own`) and set their masks."""
        return drafts

    def before_score(self, turn: Turn, drafts: Drafts) -> None:
        """Just before the Score call."""

    def score_fields(self, turn: Turn, drafts: Drafts) -> dict[str, Any]:
        """Fields this hook adds to the ScoreRequest."""
        return {}

    def scored(self, turn: Turn, drafts: Drafts, scores: Scores) -> None:
        """After the Score call: check the reply carries what this hook asked for."""

    def committed(self, turn: Turn, outcome: RoundOutcome) -> None:
        """After the commit's cuts (outcome.commit.tokens), before the tokens join the turn."""


@dataclass
class Turn:
    """One turn's state across its rounds."""

    req: TurnRequest
    config: LoopConfig
    session: Session
    tally: Tally
    trace: Any  # specdec.runtime.tracing's request trace (a no-op unless tracing is on)
    proposer: Proposer
    policy: DraftingPolicy
    sampling: WireSampling
    tokens: list[int]  # committed: the prompt, then every generated token
    fps: list[int]  # fps[i] = fingerprint(tokens[:i])
    out: TextOut
    hooks: tuple[RoundHook, ...] = ()
    observers: tuple[RoundObserver, ...] = ()  # each round's outcome goes to these, once it is whole
    logprobs: Any = None  # the LogprobsHook, when the request asks for log-probabilities
    finish: str | None = None
    sent: int = 0  # chunks streamed
    prefetch: asyncio.Future | None = None  # a first round's feeding of the draft (proposer.prefetch)

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - (len(self.tokens) - len(self.req.prompt_ids))

    def context(self, drafting: Drafting) -> DraftContext:
        """What the proposer may look at this round."""
        return DraftContext(self.session.id, self.tokens, self.fps, len(self.req.prompt_ids), drafting.k,
                            self.sampling, self.tally.seed, away=self.away, draft_off=drafting.draft_off,
                            tree_nodes=drafting.tree_nodes, tree_width=drafting.tree_width,
                            tenant=self.req.tenant)

    def extend(self, committed: list[int]) -> None:
        for token in committed:
            self.fps.append(extend(self.fps[-1], token))
        self.tokens.extend(committed)
        self.tally.new_tokens = len(self.tokens) - len(self.req.prompt_ids)

    def away(self) -> None:
        """Drafting: the target's batch calls do not wait for this session meanwhile."""
        self.session.target.client.leave(self.session.target.session_id)

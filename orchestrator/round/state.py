"""A turn's state across its rounds (`Turn`), one round's state step by step (`Round`), and the
interface of the features that ride on every round (`RoundHook`)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
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
from specdec.core.verify import Verdict


@dataclass
class Round:
    """One round, filled in by its steps: plan -> propose -> score -> verify -> commit."""

    tally: RoundTally
    remaining: int  # tokens the turn may still generate, before this round
    drafting: Drafting | None = None
    ctx: DraftContext | None = None
    proposal: Proposal | None = None
    drafted: list[int] = field(default_factory=list)  # what the target scores (the proposal, cut by hooks)
    own: int = 0  # the proposer's own tokens in `drafted` (the rest: grammar-forced)
    masks: RoundMasks | None = None  # structured output: the grammar's masks of the scored positions
    reply: Reply | None = None
    p: torch.Tensor | None = None  # rejection sampling: the target's distributions [k + 1, vocab]
    verdict: Verdict | None = None
    committed: list[int] = field(default_factory=list)  # the verdict's tokens after EOS / stop / length
    text: str = ""
    stop_hit: bool = False


class RoundHook:
    """A feature that rides on every round (a grammar, a feature relay, log-probabilities).
    Each step calls every hook of the turn in order; these defaults do nothing."""

    def drafted(self, turn: Turn, rnd: Round) -> None:
        """After propose: may cut rnd.drafted (and rnd.own) and set rnd.masks."""

    def before_score(self, turn: Turn, rnd: Round) -> None:
        """Just before the Score call."""

    def score_fields(self, turn: Turn, rnd: Round) -> dict[str, Any]:
        """Fields this hook adds to the ScoreRequest."""
        return {}

    def scored(self, turn: Turn, rnd: Round) -> None:
        """After the Score call: check the reply carries what this hook asked for."""

    def committed(self, turn: Turn, rnd: Round) -> None:
        """After the commit's cuts (rnd.committed), before the tokens join the turn."""


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
    logprobs: Any = None  # the LogprobsHook, when the request asks for log-probabilities
    finish: str | None = None
    sent: int = 0  # chunks streamed
    prefetch: asyncio.Future | None = None  # a first round's feeding of the draft (proposer.prefetch)

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - (len(self.tokens) - len(self.req.prompt_ids))

    def extend(self, committed: list[int]) -> None:
        for token in committed:
            self.fps.append(extend(self.fps[-1], token))
        self.tokens.extend(committed)
        self.tally.new_tokens = len(self.tokens) - len(self.req.prompt_ids)

    def away(self) -> None:
        """Drafting: the target's batch calls do not wait for this session meanwhile."""
        self.session.target.client.leave(self.session.target.session_id)

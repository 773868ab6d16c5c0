"""Proposers: where a round's drafted tokens come from.

One protocol, one input dataclass, one factory. The loop sees only
`Proposer.propose(DraftContext) -> Proposal`. A deterministic proposer
(prompt lookup, the caller's guess, none) returns `probs=None`; the verifier
then treats its q as one-hot, which keeps sampling exact.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from orchestrator.remote import Call, ModelClient
from specdec.core.lookup import PromptLookup
from specdec.core.sampling import SamplingParams
from specdec.errors import CacheMiss, InvalidArgument
from specdec.v1 import common_pb2, model_pb2
from specdec.wire import decode_probs, sampling_to_proto

DRAFT, LOOKUP, GUESS, NONE = "draft", "lookup", "guess", "none"
KINDS = (DRAFT, LOOKUP, GUESS, NONE)


@dataclass(frozen=True)
class DraftContext:
    """What a proposer may look at for one round. Read-only by contract."""

    session_id: str
    tokens: Sequence[int]  # committed ids: prompt + generated (do not mutate)
    prefix_fps: Sequence[int]  # prefix_fps[i] = fingerprint(tokens[:i])
    prompt_len: int
    k: int  # draft at most this many tokens
    sampling: SamplingParams
    seed: int
    draft_cached: int = 0  # committed tokens the draft replica is believed to hold


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens d_1..d_n (n <= k) and, for a model draft when sampling, q."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [n, vocab] q; None = one-hot (deterministic)
    cache_length: int = 0  # tokens the draft replica holds after the call
    call: Call | None = None  # the RPC, when there was one
    cache_misses: int = 0


class Proposer(Protocol):
    name: str

    async def propose(self, ctx: DraftContext) -> Proposal: ...


class NoProposer:
    """Target-only decoding through the same path: nothing drafted, one token per pass."""

    name = NONE

    async def propose(self, ctx: DraftContext) -> Proposal:
        return Proposal(tokens=[], cache_length=ctx.draft_cached)


class PromptLookupProposer:
    """Copy what followed the most recent earlier occurrence of the last n-gram."""

    name = LOOKUP

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1, num_tokens: int = 8) -> None:
        self._lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, num_tokens=num_tokens)

    async def propose(self, ctx: DraftContext) -> Proposal:
        fed = len(self._lookup)
        self._lookup.extend(ctx.tokens[fed:])
        return Proposal(tokens=self._lookup.propose(ctx.k), cache_length=ctx.draft_cached)


class GuessProposer:
    """The caller's expected continuation, for as long as the output follows it."""

    name = GUESS

    def __init__(self, guess_ids: Sequence[int]) -> None:
        self.guess = list(guess_ids)

    async def propose(self, ctx: DraftContext) -> Proposal:
        generated = ctx.tokens[ctx.prompt_len :]
        n = len(generated)
        if list(generated) != self.guess[:n]:
            return Proposal(tokens=[], cache_length=ctx.draft_cached)  # diverged: guess is spent
        return Proposal(tokens=self.guess[n : n + ctx.k], cache_length=ctx.draft_cached)


class DraftServiceProposer:
    """One Propose RPC to the draft service per round.

    Sends only the committed tokens the draft does not hold yet (after a fully
    accepted round: the last drafted token and the bonus token — the draft's
    catch-up). On a cache miss it resends everything from position 0, once.
    """

    name = DRAFT

    def __init__(self, client: ModelClient, p_min: float = 0.0) -> None:
        self.client = client
        self.p_min = p_min

    async def propose(self, ctx: DraftContext) -> Proposal:
        mode = common_pb2.OUTPUT_MODE_TOKENS if ctx.sampling.greedy else common_pb2.OUTPUT_MODE_PROBS
        # The draft must receive at least one token to condition on.
        cached = min(ctx.draft_cached, len(ctx.tokens) - 1)
        misses = 0
        while True:
            request = model_pb2.ProposeRequest(
                session_id=ctx.session_id,
                cache_position=cached,
                prefix_hash=ctx.prefix_fps[cached],
                tokens=ctx.tokens[cached:],
                k=ctx.k,
                sampling=sampling_to_proto(ctx.sampling),
                output_mode=mode,
                seed=ctx.seed,
                p_min=self.p_min,
            )
            try:
                response, call = await self.client.propose(request)
                break
            except CacheMiss:
                if cached == 0:
                    raise
                misses, cached = misses + 1, 0
        drafted = list(response.tokens)
        probs = None
        if mode == common_pb2.OUTPUT_MODE_PROBS and drafted:
            probs = decode_probs(response.probs)  # [n, vocab]
        return Proposal(drafted, probs, response.cache_length, call, misses)


def make_proposer(
    kind: str,
    *,
    draft: ModelClient | None = None,
    guess_ids: Sequence[int] = (),
    lookup_ngram: int = 2,
    max_k: int = 8,
) -> Proposer:
    """The one factory: a proposer by name ("draft", "lookup", "guess", "none")."""
    if kind == DRAFT:
        if draft is None:
            raise ValueError("the draft proposer needs a draft service client")
        return DraftServiceProposer(draft)
    if kind == LOOKUP:
        return PromptLookupProposer(max_ngram=lookup_ngram, num_tokens=max_k)
    if kind == GUESS:
        if not guess_ids:
            raise InvalidArgument("guess: required (non-empty) when proposer is PROPOSER_GUESS")
        return GuessProposer(guess_ids)
    if kind == NONE:
        return NoProposer()
    raise InvalidArgument(f"proposer: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


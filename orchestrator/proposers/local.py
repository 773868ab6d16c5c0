"""The proposers without a cache of their own: none (target-only), prompt lookup, the caller's
guess, and Predicted Outputs. Deterministic: each returns q = None (one-hot), so the verifier
keeps sampling exact and, coupled, the text is target-only's."""
from __future__ import annotations

from collections.abc import Sequence

from orchestrator.proposers.base import DraftContext, Proposal, Proposer
from orchestrator.common.kinds import GUESS, LOOKUP, NONE, PREDICTED_OUTPUT
from specdec.core.lookup import PromptLookup
from specdec.core.predicted_output import PredictedOutputCursor


class NoProposer(Proposer):
    """Target-only decoding through the same path: nothing drafted, one token per pass."""

    name = NONE
    proposes = False

    async def propose(self, ctx: DraftContext) -> Proposal:
        return Proposal(tokens=[])


class PromptLookupProposer(Proposer):
    """Copy what followed the most recent earlier occurrence of the last n-gram; asked for a
    tree (DraftContext.tree_nodes), what followed several recent occurrences, as a token tree."""

    name = LOOKUP
    branches = True

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1, max_k: int = 8) -> None:
        self._lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, num_tokens=max_k)

    async def propose(self, ctx: DraftContext) -> Proposal:
        fed = len(self._lookup)
        self._lookup.extend(ctx.tokens[fed:])
        if ctx.tree_nodes and ctx.k:
            tokens, parents = self._lookup.propose_tree(ctx.k, ctx.tree_nodes, max(1, ctx.tree_width))
            if any(parent != i - 1 for i, parent in enumerate(parents)):  # it branches
                return Proposal(tokens=tokens, parents=parents)
            return Proposal(tokens=tokens)
        return Proposal(tokens=self._lookup.propose(ctx.k))


class GuessProposer(Proposer):
    """The caller's expected continuation, for as long as the output follows it."""

    name = GUESS

    def __init__(self, guess_ids: Sequence[int]) -> None:
        self.guess = list(guess_ids)

    async def propose(self, ctx: DraftContext) -> Proposal:
        generated = ctx.tokens[ctx.prompt_len :]
        n = len(generated)
        if list(generated) != self.guess[:n]:
            return Proposal(tokens=[])  # diverged: the guess is spent
        return Proposal(tokens=self.guess[n : n + ctx.k])


class PredictedOutputProposer(Proposer):
    """Predicted Outputs: the caller's prediction, re-aligned after each rejection
    (specdec.core.predicted_output). Deterministic, so q is one-hot and the text is exact."""

    name = PREDICTED_OUTPUT

    def __init__(self, prediction_ids: Sequence[int]) -> None:
        self._cursor = PredictedOutputCursor(prediction_ids)

    async def propose(self, ctx: DraftContext) -> Proposal:
        self._cursor.extend(ctx.tokens[ctx.prompt_len + len(self._cursor):])
        return Proposal(tokens=self._cursor.propose(ctx.k))



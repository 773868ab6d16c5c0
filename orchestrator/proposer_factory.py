"""The one proposer factory: a request's `Proposer` from its spec.

Its own module because it is the only place that knows every kind: the
proposers (orchestrator.proposers), the parallel draft proposer
(orchestrator.parallel) and the combined one (orchestrator.combined) build on
the proposer classes, and this factory on all of them, so none of them imports
another's importer.
"""
from __future__ import annotations

from collections.abc import Callable

from orchestrator.combined import CombinedProposer
from orchestrator.parallel import ParallelDraftProposer
from orchestrator.proposers import (
    DraftServiceProposer, GuessProposer, NoProposer, PredictionProposer, PromptLookupProposer, Proposer,
)
from orchestrator.remote import place
from orchestrator.spec import COMBINED, DRAFT, GUESS, KINDS, LOOKUP, NONE, PREDICTION, GenerateSpec, LoopConfig
from specdec.core.fingerprint import prefix_fingerprints
from specdec.runtime.errors import InvalidArgument, Unavailable


async def open_proposer(
    spec: GenerateSpec, config: LoopConfig, session_id: str, draft_home: tuple[str, int],
    target: Callable[[], str] = str,
) -> Proposer:
    """The one factory: the request's proposer. A draft one is placed on the replica that holds
    the session (`draft_home`: address, tokens held) if still live, else on the least loaded.
    `target` says the session's target replica's address (the combined proposer's costs)."""
    if spec.proposer in (COMBINED, DRAFT):
        replica = await place(config.router, "draft", session_id, *draft_home)
        if replica is None and spec.strict:
            raise Unavailable("proposer: no draft service replica is available (strict)")
        parallel = config.parallel if spec.parallel is None else spec.parallel
        relays = lambda dim: config.relays.take(session_id, dim, prefix_fingerprints(spec.prompt_ids))  # noqa: E731
        if spec.proposer == DRAFT and replica is not None and parallel:
            draft = ParallelDraftProposer(replica, strict=spec.strict, max_k=config.max_k, relays=relays)
            await draft.learn_kind()  # a feature draft: the first Score brings the prompt's features
            return draft
        draft = DraftServiceProposer(replica, strict=spec.strict, relays=relays,
                                     fallback_reason="" if replica else "no draft service replica available")
        await draft.learn_kind()
        if spec.proposer == DRAFT:
            return draft
        return CombinedProposer(draft, PromptLookupProposer(max_k=config.max_k), config.costs, target)
    if spec.proposer == LOOKUP:
        return PromptLookupProposer(max_k=config.max_k)
    if spec.proposer == GUESS:
        if not spec.guess_ids:
            raise InvalidArgument("guess: required (non-empty) when proposer is PROPOSER_GUESS")
        return GuessProposer(spec.guess_ids)
    if spec.proposer == PREDICTION:
        return PredictionProposer(spec.guess_ids)
    if spec.proposer == NONE:
        return NoProposer()
    raise InvalidArgument(f"proposer: unknown kind {spec.proposer!r}; expected one of {', '.join(KINDS)}")

"""The one proposer factory: a request's `Proposer` from its req.

Its own module because it is the only place that knows every kind: the
proposers (orchestrator.proposers.base), the parallel draft proposer
(orchestrator.proposers.parallel) and the combined one (orchestrator.proposers.combined) build on
the proposer classes, and this factory on all of them, so none of them imports
another's importer.
"""
from __future__ import annotations

from collections.abc import Callable

from orchestrator.proposers.combined import CombinedProposer
from orchestrator.proposers.parallel import ParallelDraftProposer
from orchestrator.proposers.base import Proposer
from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.proposers.translated import TranslatedDraftProposer
from orchestrator.proposers.local import GuessProposer, NoProposer, PredictedOutputProposer, PromptLookupProposer
from orchestrator.fleet.remote import place
from orchestrator.kinds import COMBINED, DRAFT, GUESS, KINDS, LOOKUP, NONE, PREDICTED_OUTPUT
from orchestrator.config import LoopConfig
from orchestrator.request import TurnRequest
from specdec.core.fingerprint import prefix_fingerprints
from specdec.runtime.errors import InvalidArgument, Unavailable


async def open_proposer(
    req: TurnRequest, config: LoopConfig, session_id: str, draft_home: tuple[str, int],
    target: Callable[[], str] = str,
) -> Proposer:
    """The one factory: the request's proposer. A draft one is placed on the replica that holds
    the session (`draft_home`: address, tokens held) if still live, else on the least loaded.
    `target` says the session's target replica's address (the combined proposer's costs)."""
    if req.proposer in (COMBINED, DRAFT):
        replica = await place(config.router, "draft", session_id, *draft_home)
        if replica is None and req.strict:
            raise Unavailable("proposer: no draft service replica is available (strict)")
        parallel = config.parallel if req.parallel is None else req.parallel
        relays = lambda dim, layers=(): config.relays.take(  # noqa: E731
            session_id, dim, prefix_fingerprints(req.prompt_ids), layers)
        if config.bridge is not None:  # a draft with another tokenizer: its text, re-encoded
            draft = TranslatedDraftProposer(DraftServiceProposer(
                replica, strict=req.strict,
                fallback_reason="" if replica else "no draft service replica available"), config.bridge)
            if req.proposer == DRAFT:
                return draft
            return CombinedProposer(draft, PromptLookupProposer(max_k=config.max_k), config.costs, target)
        if req.proposer == DRAFT and replica is not None and parallel:
            draft = ParallelDraftProposer(replica, strict=req.strict, max_k=config.max_k, relays=relays)
            await draft.learn_kind()  # a feature draft: the first Score brings the prompt's features
            return draft
        draft = DraftServiceProposer(replica, strict=req.strict, relays=relays,
                                     fallback_reason="" if replica else "no draft service replica available")
        await draft.learn_kind()
        if req.proposer == DRAFT:
            return draft
        return CombinedProposer(draft, PromptLookupProposer(max_k=config.max_k), config.costs, target)
    if req.proposer == LOOKUP:
        return PromptLookupProposer(max_k=config.max_k)
    if req.proposer == GUESS:
        if not req.guess_ids:
            raise InvalidArgument("guess: required (non-empty) when proposer is PROPOSER_GUESS")
        return GuessProposer(req.guess_ids)
    if req.proposer == PREDICTED_OUTPUT:
        return PredictedOutputProposer(req.prediction if req.prediction is not None else req.guess_ids)
    if req.proposer == NONE:
        return NoProposer()
    raise InvalidArgument(f"proposer: unknown kind {req.proposer!r}; expected one of {', '.join(KINDS)}")

"""The built-in kinds' homes, and `open_proposer`: a request's `Proposer` from its kind's home.

Its own module because it knows several proposer classes: the proposers
(orchestrator.proposers.base), the parallel draft proposer
(orchestrator.proposers.parallel) and the combined one (orchestrator.proposers.combined)
build on the proposer classes, and these homes on all of them, so none of them imports
another's importer. The registry (orchestrator.proposers.registry) names each home here by
"module:attribute"; a plugin's home lives in its own package.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.config import LoopConfig
from orchestrator.fleet.remote import place
from orchestrator.common.kinds import SUFFIX
from orchestrator.proposers.base import Proposer
from orchestrator.proposers.combined import CombinedProposer
from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.proposers.local import (
    GuessProposer, NoProposer, PredictedOutputProposer, PromptLookupProposer,
)
from orchestrator.proposers.parallel import ParallelDraftProposer
from orchestrator.proposers.translated import TranslatedDraftProposer
from orchestrator.common.request import TurnRequest
from specdec.core.fingerprint import prefix_fingerprints
from specdec.runtime.errors import InvalidArgument, Unavailable


@dataclass(frozen=True)
class Opening:
    """What a home is given to open a request's proposer."""

    req: TurnRequest
    config: LoopConfig
    session_id: str
    draft_home: tuple[str, int]  # the draft replica that held the session (address, tokens held)
    target: Callable[[], str]  # the session's target replica's address, now


async def open_proposer(req: TurnRequest, config: LoopConfig, session_id: str, draft_home: tuple[str, int],
                        target: Callable[[], str] = str) -> Proposer:
    """The request's proposer, from its kind's home (made once per process: config.homes)."""
    if req.proposer not in config.homes.kinds:
        raise InvalidArgument(f"proposer: unknown kind {req.proposer!r}; expected one of "
                              f"{', '.join(config.homes.requestable())}")
    home = config.homes.get(req.proposer, config)
    return await home.open(Opening(req, config, session_id, draft_home, target))


class NoneHome:
    def __init__(self, config: LoopConfig) -> None:
        pass

    async def open(self, o: Opening) -> Proposer:
        return NoProposer()


class LookupHome(NoneHome):
    async def open(self, o: Opening) -> Proposer:
        return PromptLookupProposer(max_k=o.config.max_k)


class GuessHome(NoneHome):
    async def open(self, o: Opening) -> Proposer:
        if not o.req.guess_ids:
            raise InvalidArgument("guess: required (non-empty) when proposer is PROPOSER_GUESS")
        return GuessProposer(o.req.guess_ids)


class PredictionHome(NoneHome):
    async def open(self, o: Opening) -> Proposer:
        req = o.req
        return PredictedOutputProposer(req.prediction if req.prediction is not None else req.guess_ids)


class DraftHome(NoneHome):
    """The draft service's proposer, placed on the replica that holds the session (`draft_home`)
    if still live, else on the least loaded; sequential, parallel, or across tokenizers."""

    async def open(self, o: Opening) -> Proposer:
        req, config = o.req, o.config
        replica = await place(config.router, "draft", o.session_id, *o.draft_home)
        if replica is None and req.strict:
            raise Unavailable("proposer: no draft service replica is available (strict)")
        reason = "" if replica else "no draft service replica available"
        if config.bridge is not None:  # a draft with another tokenizer: its text, re-encoded
            inner = DraftServiceProposer(replica, strict=req.strict, fallback_reason=reason)
            return TranslatedDraftProposer(inner, config.bridge)
        relays = lambda dim, layers=(): config.relays.take(  # noqa: E731
            o.session_id, dim, prefix_fingerprints(req.prompt_ids), layers)
        parallel = config.parallel if req.parallel is None else req.parallel
        if parallel and replica is not None and self.parallel_ok:
            draft = ParallelDraftProposer(replica, strict=req.strict, max_k=config.max_k, relays=relays)
        else:
            draft = DraftServiceProposer(replica, strict=req.strict, relays=relays, fallback_reason=reason)
        await draft.learn_kind()  # a feature draft: the first Score brings the prompt's features
        return draft

    parallel_ok = True


class CombinedHome(DraftHome):
    """Per round, a free guess (prompt lookup, suffix decoding over the suffix kind's cache) or the
    draft (orchestrator.proposers.combined)."""

    parallel_ok = False  # the combined proposer drafts sequentially

    async def open(self, o: Opening) -> Proposer:
        draft = await super().open(o)
        suffix = o.config.homes.get(SUFFIX, o.config)  # one cache for suffix and combined turns
        free = [PromptLookupProposer(max_k=o.config.max_k), suffix.proposer(o.req.tenant)]
        return CombinedProposer(draft, free, o.config.costs, o.target)

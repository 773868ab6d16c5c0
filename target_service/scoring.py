"""Score: one step over the new tokens and the drafts; results for the last k + 1 positions.

Runs on the model worker, batched with other sessions' calls (ModelHost.serve).
The argmax and, in PROBS mode, the distributions of every row of a forward are
computed together by the engine's sampler (engine.sampler). The cache keeps
every token sent, drafted ones included; the next call's cache_position crops
rejected ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from prometheus_client import Counter

from engine.host import ModelHost, SessionWork, Work
from engine.plan import OutputSpec, RowOutput
from engine.scheduler import Step
from engine.sessions import CachedSession
from specdec.errors import InvalidArgument
from specdec.hosting.requests import ModelRequest

TOKENS_SCORED = Counter("specdec_tokens_scored_total", "Tokens fed through Score forwards")


@dataclass(frozen=True)
class Scores:
    argmax_ids: list[int]  # [k + 1]: entry i is the target's choice after tokens[len - k - 1 + i]
    probs: torch.Tensor | None  # [k + 1, vocab] float32 on the CPU, PROBS mode only


def check_score(request: ModelRequest) -> None:
    """Score's own limit: the first drafted token is scored by the logits of the
    token before it, which must be in this request."""
    if request.k > len(request.tokens) - 1:
        raise InvalidArgument(
            f"k {request.k} must be at most len(tokens) - 1 = {len(request.tokens) - 1}"
        )


class ScoreWork(Work[Scores]):
    """Feed request.tokens (one step); argmax (and p) of the last k + 1 positions."""

    verb = "score"

    def __init__(self, request: ModelRequest):
        self.request = request
        self.session_id = request.session_id
        self.cache_position = request.cache_position
        self.prefix_hash = request.prefix_hash
        self.scores: Scores | None = None

    def begin(self) -> Step:
        request = self.request
        return Step(request.tokens, request.k + 1, OutputSpec(request.sampling, probs=request.want_probs))

    def advance(self, session: CachedSession, out: RowOutput) -> None:
        self.scores = Scores(out.argmax, out.probs)
        return None

    def result(self) -> Scores:
        assert self.scores is not None
        return self.scores


async def score(host: ModelHost, request: ModelRequest) -> SessionWork[Scores]:
    """In process: append request.tokens to the session's cache; argmax (and p) of the last k + 1."""
    return await host.serve(ScoreWork(request))

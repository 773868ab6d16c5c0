"""Score: one step over the new tokens and the drafts; results for the last k + 1 positions.

Runs on the model worker, batched with other sessions' calls (ModelHost.serve).
The cache keeps every token sent, drafted ones included; the next call's
cache_position crops rejected ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from prometheus_client import Counter

from specdec.core.sampling import probs_from_logits
from specdec.errors import InvalidArgument
from specdec.hosting.host import ModelHost, SessionWork, Work
from specdec.hosting.batching import Step
from specdec.hosting.kvcache import CachedSession
from specdec.hosting.requests import ModelRequest

TOKENS_SCORED = Counter("specdec_tokens_scored_total", "Tokens fed through Score forwards")


@dataclass(frozen=True)
class Scores:
    argmax_ids: list[int]  # [k + 1]: entry i is the target's choice after tokens[len - k - 1 + i]
    probs: torch.Tensor | None  # [k + 1, vocab] on the model's device, PROBS mode only


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
        return Step(self.request.tokens, self.request.k + 1)

    def advance(self, session: CachedSession, logits: torch.Tensor) -> None:
        # logits [k + 1, vocab]; sampling is this request's own, whatever else shared the forward
        argmax = logits.argmax(dim=-1).tolist()
        probs = probs_from_logits(logits, self.request.sampling) if self.request.want_probs else None
        self.scores = Scores(argmax, probs)
        return None

    def result(self) -> Scores:
        assert self.scores is not None
        return self.scores


async def score(host: ModelHost, request: ModelRequest) -> SessionWork[Scores]:
    """Append request.tokens to the session's cache; argmax (and p) of the last k + 1."""
    done = await host.serve(ScoreWork(request))
    TOKENS_SCORED.inc(len(request.tokens))
    return done

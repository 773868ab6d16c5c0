"""Score: one forward over the new tokens and the drafts; results for the last k + 1 positions.

Runs on the model worker (ModelHost.run). The cache keeps every token sent,
drafted ones included; the next call's cache_position crops rejected ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from prometheus_client import Counter

from specdec.core.sampling import probs_from_logits
from specdec.errors import InvalidArgument
from specdec.hosting import metrics
from specdec.hosting.host import ModelHost, SessionWork
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


def score(host: ModelHost, request: ModelRequest) -> SessionWork[Scores]:
    """Append request.tokens to the session's cache in ONE forward; argmax (and p) of the last k + 1."""

    def work(session) -> Scores:
        logits = host.forward(session, request.tokens, request.k + 1)  # [k + 1, vocab]
        argmax = logits.argmax(dim=-1).tolist()
        probs = probs_from_logits(logits, request.sampling) if request.want_probs else None
        return Scores(argmax, probs)

    done = host.on_session(request.session_id, request.cache_position, request.prefix_hash, work)
    metrics.FORWARD_SECONDS.labels("score").observe(done.forward_ms / 1e3)
    TOKENS_SCORED.inc(len(request.tokens))
    return done

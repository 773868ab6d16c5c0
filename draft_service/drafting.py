"""Propose: feed the new committed tokens, then draft up to k tokens autoregressively.

Runs on the model worker (ModelHost.serve), batched with other sessions.
Stops early before a token whose draft confidence (the top probability of the
untransformed softmax) is below p_min, after an EOS token, and at the context
length. The cache ends holding
the committed tokens plus every drafted token but the last (which was sampled,
never fed back): cache_length = cache_position + len(tokens) + max(len(drafted) - 1, 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from prometheus_client import Counter

from specdec.core.rng import Purpose, uniform
from specdec.core.sampling import probs_from_logits, sample
from specdec.errors import InvalidArgument
from specdec.hosting.batching import Step
from specdec.hosting.host import ModelHost, SessionWork, Work
from specdec.hosting.kvcache import CachedSession
from specdec.hosting.requests import ModelRequest

TOKENS_DRAFTED = Counter("specdec_tokens_drafted_total", "Tokens returned by Propose")
TOKENS_PREFILLED = Counter(
    "specdec_tokens_prefilled_total", "Committed tokens fed to the draft by Propose"
)


@dataclass(frozen=True)
class Drafts:
    tokens: list[int]  # drafted, 0..k of them
    probs: torch.Tensor | None  # [len(tokens), vocab] draft distributions q, PROBS mode only


def check_p_min(p_min: float) -> float:
    if not (math.isfinite(p_min) and 0.0 <= p_min <= 1.0):
        raise InvalidArgument(f"p_min must be in [0, 1], got {p_min}")
    return p_min


class ProposeWork(Work[Drafts]):
    """Feed the committed tokens, then one step per drafted token until k, EOS, p_min or the context end."""

    verb = "propose"

    def __init__(self, host: ModelHost, request: ModelRequest, seed: int, p_min: float):
        self.request, self.seed, self.p_min = request, seed, p_min
        self.session_id = request.session_id
        self.cache_position = request.cache_position
        self.prefix_hash = request.prefix_hash
        self.eos_ids = host.eos_ids
        self.vocab_size = host.loaded.vocab_size
        self.device = host.device
        self.context_length = host.loaded.context_length
        self.drafted: list[int] = []
        self.rows: list[torch.Tensor] = []  # [1, vocab] each, PROBS mode only
        self.k = 0
        self.position = 0  # absolute position of the first drafted token

    def begin(self) -> Step:
        request = self.request
        self.position = request.cache_position + len(request.tokens)
        room = self.context_length - self.position if self.context_length else request.k
        self.k = max(0, min(request.k, room))
        return Step(request.tokens, 1)

    def advance(self, session: CachedSession, logits: torch.Tensor) -> Step | None:
        # logits [1, vocab]: the draft's next-token distribution after everything fed so far
        drafted, sampling, want_probs = self.drafted, self.request.sampling, self.request.want_probs
        i = len(drafted)
        if i >= self.k:
            return None
        if self.p_min > 0.0 and torch.softmax(logits.float(), dim=-1).max().item() < self.p_min:
            if drafted:
                session.crop(session.length - 1)  # keep "all but the last" uniform
            return None
        if sampling.greedy:
            token = int(logits.float().argmax(dim=-1).item())
            q = probs_from_logits(logits, sampling) if want_probs else None
        else:
            q = probs_from_logits(logits, sampling)  # [1, vocab]
            u = torch.tensor([uniform(self.seed, self.position + i, Purpose.DRAFT)], dtype=torch.float64)
            token = int(sample(q, u).item())
        drafted.append(token)
        if want_probs:
            self.rows.append(q)
        if token in self.eos_ids or len(drafted) >= self.k:
            return None  # the last drafted token is never fed back
        return Step([token], 1)

    def result(self) -> Drafts:
        probs = None
        if self.request.want_probs:
            probs = torch.cat(self.rows) if self.rows else torch.zeros(0, self.vocab_size, device=self.device)
        return Drafts(list(self.drafted), probs)


async def propose(host: ModelHost, request: ModelRequest, seed: int, p_min: float) -> SessionWork[Drafts]:
    """Draft up to request.k tokens; the draw at absolute position P is uniform(seed, P, DRAFT).

    The k draft steps run batched with other sessions' steps; a session with a
    smaller k (or an early stop) leaves the batch early.
    """
    done = await host.serve(ProposeWork(host, request, seed, p_min))
    TOKENS_DRAFTED.inc(len(done.value.tokens))
    TOKENS_PREFILLED.inc(len(request.tokens))
    return done

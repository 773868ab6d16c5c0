"""Propose: feed the new committed tokens, then draft up to k tokens autoregressively.

Runs on the model worker (ModelHost.run). Stops early before a token whose
draft confidence (the top probability of the untransformed softmax) is below
p_min, after an EOS token, and at the context length. The cache ends holding
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
from specdec.hosting import metrics
from specdec.hosting.host import ModelHost, SessionWork
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


def propose(host: ModelHost, request: ModelRequest, seed: int, p_min: float) -> SessionWork[Drafts]:
    """Draft up to request.k tokens; the draw at absolute position P is uniform(seed, P, DRAFT)."""
    sampling, want_probs = request.sampling, request.want_probs
    context_length = host.loaded.context_length

    def work(session: CachedSession) -> Drafts:
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        position = session.length + len(request.tokens)  # absolute position of the next token
        room = context_length - position if context_length else request.k
        k = max(0, min(request.k, room))
        logits = host.forward(session, request.tokens, 1)  # [1, vocab]
        for i in range(k):
            if i > 0:
                logits = host.forward(session, drafted[-1:], 1)
            if p_min > 0.0 and torch.softmax(logits.float(), dim=-1).max().item() < p_min:
                if drafted:
                    session.crop(session.length - 1)  # keep "all but the last" uniform
                break
            if sampling.greedy:
                token = int(logits.float().argmax(dim=-1).item())
                q = probs_from_logits(logits, sampling) if want_probs else None
            else:
                q = probs_from_logits(logits, sampling)  # [1, vocab]
                u = torch.tensor([uniform(seed, position + i, Purpose.DRAFT)], dtype=torch.float64)
                token = int(sample(q, u).item())
            drafted.append(token)
            if want_probs:
                rows.append(q)
            if token in host.eos_ids:
                break
        probs = None
        if want_probs:
            probs = torch.cat(rows) if rows else torch.zeros(0, host.loaded.vocab_size, device=host.device)
        return Drafts(drafted, probs)

    done = host.on_session(request.session_id, request.cache_position, request.prefix_hash, work)
    metrics.FORWARD_SECONDS.labels("propose").observe(done.forward_ms / 1e3)
    TOKENS_DRAFTED.inc(len(done.value.tokens))
    TOKENS_PREFILLED.inc(len(request.tokens))
    return done

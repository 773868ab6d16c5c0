"""Propose: feed the new committed tokens, then draft up to k tokens autoregressively.

Runs on the model worker (ModelHost.serve), batched with other sessions: each
drafting step is one row of a forward, and the engine's sampler draws every
row's token (and, in PROBS mode, returns its q) in one call. Stops early before
a token whose draft confidence (the top probability of the untransformed
softmax) is below p_min, after an EOS token, and at the context length. The
cache ends holding the committed tokens plus every drafted token but the last
(which was sampled, never fed back):
cache_length = cache_position + len(tokens) + max(len(drafted) - 1, 0).

A feature head (engine.model.drafts, ModelInfo.feature_dim > 0) reads a target
feature with every token: the request's rows for the tokens that have one (in
one step), then the head's own output at the previous position for the rest
(one step each), and for every drafted token. Its own output at the last fed
position is kept on the session (CachedSession.tail) for a call that brings no
feature for its first token (a pre-draft continuing from its own drafts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from prometheus_client import Counter

from engine.host import ModelHost, SessionWork, Work
from engine.plan import LAST, OutputSpec, RowOutput
from engine.scheduler import Step
from engine.sessions import CachedSession
from specdec.core.rng import Purpose, uniform
from specdec.runtime.errors import CacheMiss, InvalidArgument
from model_service.requests import ModelRequest

TOKENS_PREFILLED = Counter(
    "specdec_tokens_prefilled_total", "Committed tokens fed to the draft by Propose"
)


@dataclass(frozen=True)
class Drafts:
    tokens: list[int]  # drafted, 0..k of them
    probs: torch.Tensor | None  # [len(tokens), vocab] draft distributions q on the CPU, PROBS mode only


def check_p_min(p_min: float) -> float:
    if not (math.isfinite(p_min) and 0.0 <= p_min <= 1.0):
        raise InvalidArgument(f"p_min must be in [0, 1], got {p_min}")
    return p_min


class HeadFeed:
    """A feature head's feeding of the committed tokens (see the module docstring): the request's
    rows in one step, the rest one step each on the head's own output at the previous position;
    its output at the last fed position is `own` ([1, H]) and the session's tail."""

    def __init__(self, request: ModelRequest, features: torch.Tensor | None):
        self.request, self.features = request, features
        self.pending: list[int] = []  # tokens still to feed on the head's own features
        self.own: torch.Tensor | None = None

    def begin(self, output: OutputSpec) -> Step:
        """The first feeding step; `output` is the last one's (the first draft's), if this is it."""
        request = self.request
        rows = 0 if self.features is None else int(self.features.shape[0])
        first = max(rows, 1)  # no row at all: the first token reads the session's tail (joined)
        self.pending = list(request.tokens[first:])
        features = self.features[:first] if rows else None
        if rows and request.cache_position == 0:
            features = features.clone()
            features[0] = 0.0  # nothing precedes position 0
        return self._feed(request.tokens[:first], features, output)

    def _feed(self, tokens, features, output: OutputSpec) -> Step:
        """A feeding step: logits only at the last token before drafting."""
        last = not self.pending
        return Step(tokens, 1 if last else 0, output if last else OutputSpec(), features=features, hidden=LAST)

    def joined(self, session: CachedSession, step: Step) -> Step:
        if step.features is not None or self.request.cache_position == 0:
            return step  # (position 0 reads zeros: features None)
        if session.tail is None or session.tail_length != self.request.cache_position:
            raise CacheMiss(f"features: no feature for position {self.request.cache_position - 1} (the head "
                            "keeps its own only at its last fed position); send the target's")
        return step._replace(features=session.tail[None])

    def fed(self, session: CachedSession, out: RowOutput, output: OutputSpec) -> Step | None:
        """Take a feeding step's outputs: the next feeding step, or None once every token is fed."""
        self.own = out.hidden[-1:]  # [1, H]: predicts the target's feature at the last fed position
        session.tail, session.tail_length = out.hidden[-1], session.length
        if self.pending:
            return self._feed([self.pending.pop(0)], self.own, output)
        return None


class ProposeWork(Work[Drafts]):
    """Feed the committed tokens, then one step per drafted token until k, EOS, p_min or the context end."""

    verb = "propose"

    def __init__(self, host: ModelHost, request: ModelRequest, seed: int, p_min: float,
                 features: torch.Tensor | None = None):
        self.request, self.seed, self.p_min = request, seed, p_min
        # A feature head: the target features of the first len(features) tokens ([r, H]).
        self.head = HeadFeed(request, features) if host.loaded.feature_dim > 0 else None
        self.session_id = request.session_id
        self.cache_position = request.cache_position
        self.prefix_hash = request.prefix_hash
        self.eos_ids = host.eos_ids
        self.vocab_size = host.loaded.vocab_size
        self.context_length = host.loaded.context_length
        self.drafted: list[int] = []
        self.rows: list[torch.Tensor] = []  # [1, vocab] each, PROBS mode only
        self.k = 0
        self.position = 0  # absolute position of the first drafted token

    def _output(self) -> OutputSpec:
        """What the next step must return: the draw (sampling: coupled, or by the DRAFT uniform),
        q (PROBS), the confidence (p_min)."""
        sampling, coupled = self.request.sampling, self.request.coupled_seed
        draw = () if sampling.greedy or coupled is not None else (
            uniform(self.seed, self.position + len(self.drafted), Purpose.DRAFT),)
        return OutputSpec(sampling, probs=self.request.want_probs, uniforms=draw, top_prob=self.p_min > 0.0,
                          coupled_seed=coupled)

    def begin(self) -> Step:
        request = self.request
        self.position = request.cache_position + len(request.tokens)
        room = self.context_length - self.position if self.context_length else request.k
        self.k = max(0, min(request.k, room))
        if self.head is None:  # k = 0 only feeds the tokens (no output: nothing is drafted)
            return Step(request.tokens, 1, self._output()) if self.k else Step(request.tokens, 0)
        return self.head.begin(self._output())

    def joined(self, session: CachedSession, step: Step) -> Step:
        return self.head.joined(session, step) if self.head is not None else step

    def advance(self, session: CachedSession, out: RowOutput) -> Step | None:
        # out: the draft's next-token outputs after everything fed so far
        if self.head is not None:
            feed = self.head.fed(session, out, self._output())
            if feed is not None:
                return feed
        drafted = self.drafted
        if len(drafted) >= self.k:
            return None
        if self.p_min > 0.0 and out.top_prob[0] < self.p_min:
            if drafted:
                session.crop(session.length - 1)  # keep "all but the last" uniform
            return None
        token = out.argmax[0] if self.request.sampling.greedy else out.sampled[0]
        drafted.append(token)
        if self.request.want_probs:
            self.rows.append(out.probs)
        if token in self.eos_ids or len(drafted) >= self.k:
            return None  # the last drafted token is never fed back
        if self.head is not None:
            return Step([token], 1, self._output(), features=self.head.own, hidden=LAST)
        return Step([token], 1, self._output())

    def result(self) -> Drafts:
        probs = None
        if self.request.want_probs:
            probs = torch.cat(self.rows) if self.rows else torch.zeros(0, self.vocab_size)
        return Drafts(list(self.drafted), probs)


async def propose(host: ModelHost, request: ModelRequest, seed: int, p_min: float) -> SessionWork[Drafts]:
    """Draft up to request.k tokens; the draw at absolute position P is uniform(seed, P, DRAFT)
    (or, COUPLED, the coupled sampler's with the noise of (seed, P)).

    In process. The k draft steps run batched with other sessions' steps; a
    session with a smaller k (or an early stop) leaves the batch early.
    """
    return await host.serve(ProposeWork(host, request, seed, p_min))

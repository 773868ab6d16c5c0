"""Score: one step over the new tokens and the drafts; results for the last k + 1 positions.

Runs on the model worker, batched with other sessions' calls (ModelHost.serve).
The argmax and, in PROBS mode, the distributions (in COUPLED mode, the coupled
draws) of every row of a forward are computed together by the engine's sampler
(engine.sampler). The cache keeps
every token sent, drafted ones included; the next call's cache_position crops
rejected ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter

from engine.host import ModelHost, SessionWork, Work
from engine.plan import LAST, OutputSpec, RowLogprobs, RowOutput
from engine.scheduler import Step
from engine.sessions import CachedSession
from specdec.core import masks
from specdec.runtime.errors import InvalidArgument
from specdec.runtime.limits import MAX_FEATURE_LAYERS
from model_service.requests import ModelRequest
from specdec.runtime.wire import check_feature_encoding

TOKENS_SCORED = Counter("specdec_tokens_scored_total", "Tokens fed through Score forwards")

MAX_LOGPROBS = 20  # ScoreRequest.logprobs (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class Scores:
    argmax_ids: list[int]  # [k + 1]: entry i is the target's choice after tokens[len - k - 1 + i]
    probs: torch.Tensor | None  # [k + 1, vocab] float32 on the CPU, PROBS mode only
    logprobs: RowLogprobs | None = None  # ScoreRequest.logprobs > 0 only
    # [len(tokens), H] (x len(feature_layers)) features of every token sent (ScoreRequest.features)
    hidden: torch.Tensor | None = None
    sampled_ids: list[int] | None = None  # [k + 1] the coupled draws (COUPLED mode; greedy: the argmax)


@dataclass(frozen=True)
class ScoreExtras:
    """Score's own optional inputs: a grammar mask per scored position, top-n log-probabilities."""

    allowed: bytes = b""  # packed words, k + 1 rows (specdec.core.masks); b"" = none
    logprobs: int = 0
    features: int = 0  # a FeatureEncoding: return every token's feature; 0 = none
    feature_layers: tuple[int, ...] = ()  # ScoreRequest.feature_layers (() = the final normed state)


def decode_extras(request: Any, k: int, vocab_size: int) -> ScoreExtras:
    """ScoreRequest.allowed and .logprobs, checked (each error names its field)."""
    logprobs = int(request.logprobs)
    if logprobs > MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}")
    features = check_feature_encoding(int(getattr(request, "features", 0)))
    layers = check_feature_layers(tuple(int(i) for i in getattr(request, "feature_layers", ())), features)
    if not request.HasField("allowed") or request.allowed.rows == 0:
        if request.HasField("allowed") and request.allowed.bits:
            raise InvalidArgument("allowed.bits must be empty when allowed.rows is 0")
        return ScoreExtras(logprobs=logprobs, features=features, feature_layers=layers)
    rows = int(request.allowed.rows)
    if rows != k + 1:
        raise InvalidArgument(f"allowed.rows must be 0 or k + 1 = {k + 1}, got {rows}")
    words = masks.words_per_position(vocab_size)
    bits = bytes(request.allowed.bits)
    if len(bits) != rows * words * 4:
        raise InvalidArgument(f"allowed.bits must hold rows * ceil(vocab_size / 32) * 4 = "
                              f"{rows * words * 4} bytes, got {len(bits)}")
    packed = masks.from_bytes(bits, rows)
    empty = ~packed.any(axis=1)
    if empty.any():
        raise InvalidArgument(f"allowed: row {int(np.argmax(empty))} allows no token")
    return ScoreExtras(bits, logprobs, features, layers)


def check_feature_layers(layers: tuple[int, ...], features: int, num_layers: int | None = None) -> tuple[int, ...]:
    """ScoreRequest.feature_layers, checked: with `features`, distinct, at most MAX_FEATURE_LAYERS,
    each a decoder layer of the model (below `num_layers`, where given)."""
    if not layers:
        return ()
    if not features:
        raise InvalidArgument("feature_layers: set features (an encoding) to have them returned")
    if len(layers) > MAX_FEATURE_LAYERS or len(set(layers)) != len(layers):
        raise InvalidArgument(f"feature_layers: at most {MAX_FEATURE_LAYERS} distinct layer ids, got {list(layers)}")
    if num_layers is not None and max(layers) >= num_layers:
        raise InvalidArgument(f"feature_layers: layer {max(layers)} does not exist: this model has "
                              f"{num_layers} decoder layers (ids 0..{num_layers - 1})")
    return layers


def check_score(request: ModelRequest) -> None:
    """Score's own limits: the first drafted token is scored by the logits of the token before it,
    which must be in this request. A tree's rows: row 0 is the committed tokens', row i + 1 the one
    after drafted token i on its path (grammar masks and log-probabilities by row; Logprobs.drafted
    has each node's under its parent's row); features are one row per token sent."""
    if request.k > len(request.tokens) - 1:
        raise InvalidArgument(
            f"k {request.k} must be at most len(tokens) - 1 = {len(request.tokens) - 1}"
        )


class ScoreWork(Work[Scores]):
    """Feed request.tokens (one step); argmax (and p) of the last k + 1 positions."""

    verb = "score"

    def __init__(self, request: ModelRequest, extras: ScoreExtras = ScoreExtras()):
        self.request = request
        self.extras = extras
        self.session_id = request.session_id
        self.cache_position = request.cache_position
        self.prefix_hash = request.prefix_hash
        self.scores: Scores | None = None

    def begin(self) -> Step:
        request = self.request
        return Step(request.tokens, request.k + 1, OutputSpec(
            request.sampling, probs=request.want_probs, coupled_seed=request.coupled_seed,
            allowed=self.extras.allowed, logprobs=self.extras.logprobs,
            tree_parents=tuple(request.parents) if request.parents and self.extras.logprobs else ()),
            hidden=(self.extras.feature_layers or LAST) if self.extras.features else (),
            parents=request.parents or None)

    def advance(self, session: CachedSession, out: RowOutput) -> None:
        sampled = out.argmax if self.request.coupled_seed is not None and out.sampled is None else out.sampled
        self.scores = Scores(out.argmax, out.probs, out.logprobs, out.hidden if self.extras.features else None,
                             sampled if self.request.coupled_seed is not None else None)
        return None

    def result(self) -> Scores:
        assert self.scores is not None
        return self.scores


async def score(host: ModelHost, request: ModelRequest) -> SessionWork[Scores]:
    """In process: append request.tokens to the session's cache; argmax (and p) of the last k + 1."""
    return await host.serve(ScoreWork(request))

"""The one decode-and-validate path for a model request (Score and Propose alike).

ScoreRequest and ProposeRequest share their first seven fields (session,
cache_position, prefix_hash, tokens, k, sampling, output_mode) and a seed, so one
function checks them; each role adds only its own extra check
(target_service.scoring: k fits in tokens; draft_service.drafting: p_min).
Every error names the offending field (the statuses in model.proto).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.core.sampling import SamplingParams
from specdec.runtime.errors import InvalidArgument, OutOfRange, ResourceExhausted
from specdec.runtime.limits import MAX_SESSION_ID
from engine.host import HostLimits
from engine.model.loader import LoadedModel
from specdec.v1 import common_pb2
from specdec.runtime.wire import sampling_from_proto


@dataclass(frozen=True)
class ModelRequest:
    """A validated Score or Propose request, in core types."""

    session_id: str
    cache_position: int
    prefix_hash: int
    tokens: list[int]  # uncached tokens; for Score the last k are drafted
    k: int  # drafted tokens: to score (Score) or to draft at most (Propose)
    sampling: SamplingParams
    want_probs: bool  # OUTPUT_MODE_PROBS: return distributions, not only token ids
    # OUTPUT_MODE_COUPLED: sampled tokens are drawn by the coupled sampler with this seed's
    # noise (specdec.core.sampling.coupled_draws); None = not coupled.
    coupled_seed: int | None = None
    # Token trees. Score: the parent of each drafted token (-1: the last committed token); empty = a
    # chain. Propose: the most tokens to draft as a tree (0 = a chain), and the candidates per node.
    parents: tuple[int, ...] = ()
    tree_nodes: int = 0
    tree_width: int = 0


def require_session_id(session_id: str) -> str:
    if not session_id:
        raise InvalidArgument("session_id must not be empty")
    return session_id


_OUTPUT_MODES = (common_pb2.OUTPUT_MODE_UNSPECIFIED, common_pb2.OUTPUT_MODE_TOKENS,
                 common_pb2.OUTPUT_MODE_PROBS, common_pb2.OUTPUT_MODE_COUPLED)


def check_output_mode(output_mode: int) -> int:
    """The request's OutputMode (UNSPECIFIED means TOKENS); unknown values are rejected."""
    if output_mode not in _OUTPUT_MODES:
        raise InvalidArgument(f"output_mode {output_mode} is not a known OutputMode")
    return output_mode


def decode_request(request: Any, model: LoadedModel, limits: HostLimits) -> ModelRequest:
    """Check a ScoreRequest or ProposeRequest against the model and limits (cheap, on the event loop)."""
    session_id = require_session_id(request.session_id)
    if len(session_id) > MAX_SESSION_ID:
        raise InvalidArgument(f"session_id must be at most {MAX_SESSION_ID} characters")
    tokens = list(request.tokens)
    if not tokens:
        raise InvalidArgument("tokens must hold at least 1 token, got 0")
    if len(tokens) > limits.max_request_tokens:
        raise ResourceExhausted(
            f"tokens: {len(tokens)} tokens in one request exceeds this server's "
            f"limit of {limits.max_request_tokens}; send them in several calls"
        )
    vocab = model.vocab_size
    if min(tokens) < 0 or max(tokens) >= vocab:
        bad = next(i for i, t in enumerate(tokens) if not 0 <= t < vocab)
        raise InvalidArgument(f"tokens[{bad}] = {tokens[bad]} is outside the vocabulary [0, {vocab})")
    cache_position = int(request.cache_position)
    context = model.context_length
    if context and cache_position + len(tokens) > context:
        raise OutOfRange(
            f"cache_position + len(tokens) = {cache_position + len(tokens)} exceeds the "
            f"context length {context}"
        )
    k = int(request.k)
    if k > limits.max_k:
        raise InvalidArgument(f"k {k} exceeds this server's max of {limits.max_k}")
    sampling = sampling_from_proto(request.sampling if request.HasField("sampling") else None)
    mode = check_output_mode(request.output_mode)
    return ModelRequest(
        session_id=session_id,
        cache_position=cache_position,
        prefix_hash=int(request.prefix_hash),
        tokens=tokens,
        k=k,
        sampling=sampling,
        want_probs=mode == common_pb2.OUTPUT_MODE_PROBS,
        coupled_seed=int(request.seed) if mode == common_pb2.OUTPUT_MODE_COUPLED else None,
        parents=_parents(request, k),
        tree_nodes=int(getattr(request, "tree_nodes", 0)),
        tree_width=int(getattr(request, "tree_width", 0)),
    )


def _parents(request: Any, k: int) -> tuple[int, ...]:
    """ScoreRequest.parents, checked: none (a chain), or k entries each -1 or an earlier draft's index."""
    parents = tuple(int(p) for p in getattr(request, "parents", ()))
    if parents and len(parents) != k:
        raise InvalidArgument(f"parents: {len(parents)} entries for k = {k} drafted tokens (one each, or none)")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise InvalidArgument(f"parents[{i}] = {parent}: a parent is an earlier drafted token's index "
                                  "or -1 (the last committed token)")
    return parents

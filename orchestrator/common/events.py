"""What a turn streams: a `ChunkEvent` per round that commits tokens (then the turn's Tally)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundDetail:
    """What one round proposed and committed (TurnRequest.round_tokens): Chunk.round."""

    index: int  # 1-based: the target passes so far
    source: str  # what drafted ("" = nothing)
    drafted: list[int]
    accepted: int
    extra_kind: str  # specdec.core.verify RECOVERED or BONUS
    committed: list[int]  # accepted drafts + the extra token, after EOS / stop / length cuts


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a committed token (model.proto Logprobs says which p)."""

    token_id: int
    logprob: float
    top_ids: list[int]  # TurnRequest.top_logprobs alternatives, most likely first
    top_logprobs: list[float]


@dataclass(frozen=True)
class ChunkEvent:
    text: str
    token_ids: list[int]
    start_index: int = 0  # index of token_ids[0] in the session's tokens (prompt included)
    session_id: str = ""  # on the stream's first chunk (what a resume names)
    round: RoundDetail | None = None  # TurnRequest.round_tokens only
    logprobs: list[TokenLogprob] | None = None  # TurnRequest.logprobs only: one per token_ids entry
    # On the first chunk: the target and draft replicas holding the session's KV ("" = none),
    # which the other choices of an n > 1 request fork the prefilled prompt from.
    replicas: tuple[str, str] = ("", "")

"""A turn's text out: committed tokens to text deltas, cut after a stop string.

The decoder (orchestrator.round.text.IncrementalDecoder) holds back an
incomplete UTF-8 character; the stop-string hold-back (specdec.core.stopping)
holds back text that could begin a stop string. A resume replays the delivered
tokens through both (their text was streamed before) and finds whether they had
already ended the turn.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from orchestrator.round.text import IncrementalDecoder
from specdec.core.stopping import STOP, StopStringHoldback, clip_to_stop
from specdec.runtime.errors import InvalidArgument


class TextOut:
    """The decoder and the stop-string hold-back of one turn."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self.holdback = StopStringHoldback(stop) if stop else None

    def push(self, committed: list[int]) -> tuple[str, list[int], bool]:
        """(text, tokens kept, stop hit) for newly committed tokens: with stop strings, the tokens
        are cut after the one completing a stop string."""
        if self.holdback is None:
            return self.decoder.push(committed), committed, False
        text = ""
        for i, token in enumerate(committed):
            piece, hit = self.holdback.push(self.decoder.push([token]))
            text += piece
            if hit:
                return text, committed[: i + 1], True
        return text, committed, False

    def release(self) -> str:
        """At a finish without a stop hit: the decoder's and the hold-back's remaining text."""
        tail = self.decoder.flush()
        if self.holdback is None:
            return tail
        piece, hit = self.holdback.push(tail)
        return piece if hit else piece + self.holdback.flush()

    def replay(self, delivered: list[int], *, eos_ids: Collection[int], max_new_tokens: int) -> str | None:
        """A resume: the client's tokens as if just committed (their text was streamed before).
        The turn's finish reason if they end it; tokens past its end are INVALID_ARGUMENT."""
        if not delivered:
            return None
        _, kept, hit = self.push(delivered)
        if hit:
            if len(kept) < len(delivered):
                raise InvalidArgument("delivered: tokens after the one completing a stop string")
            return STOP
        kept, finish = clip_to_stop(delivered, eos_ids=eos_ids, remaining=max_new_tokens)
        if len(kept) < len(delivered):
            raise InvalidArgument("delivered: tokens after the end of the turn (an EOS, or max_new_tokens)")
        return finish

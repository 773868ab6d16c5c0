"""A turn's text out: committed tokens to text deltas, cut after a stop string.

The decoder (orchestrator.common.text.IncrementalDecoder) holds back an
incomplete UTF-8 character; the stop-string hold-back (specdec.core.stopping)
holds back text that could begin a stop string. A resume replays the delivered
tokens through both (their text was streamed before) and finds whether they had
already ended the turn.

A turn ends at an end token: an EOS (unless ignore_eos; the round's commit cuts
there) or one of the request's stop_token_ids (cut here, as a stop string is). The
token is committed; its text is shown only with include_stop_str_in_output. A stop
token is a stop hit (finish_reason "stop"), so the text held back before it is
released at once.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from orchestrator.common.text import IncrementalDecoder
from specdec.core.stopping import STOP, StopStringHoldback, clip_to_stop
from specdec.runtime.errors import InvalidArgument


class TextOut:
    """The decoder, the stop-string hold-back and the end tokens of one turn."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str], *,
                 eos_ids: Collection[int] = (), stop_ids: Collection[int] = (),
                 keep_special: bool = False, include_stop: bool = False) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids, keep_special=keep_special)
        self.holdback = StopStringHoldback(stop, include=include_stop) if stop else None
        self.stop_ids = frozenset(stop_ids)
        self.end_ids = frozenset(eos_ids) | self.stop_ids  # the turn ends at the first one committed
        self.include_stop = include_stop

    def push(self, committed: list[int]) -> tuple[str, list[int], bool]:
        """(text, tokens kept, stop hit) for newly committed tokens (already cut at an EOS by
        specdec.core.stopping.clip_to_stop): the tokens are cut after a stop token, a stop hit,
        or after the one completing a stop string."""
        cut = next((i for i, token in enumerate(committed) if token in self.end_ids), None)
        end = committed[cut] if cut is not None else None
        committed = committed if cut is None else committed[:cut + 1]
        shown = committed if end is None or self.include_stop else committed[:-1]
        text, kept, hit = self._push(shown)
        if hit:
            return text, kept, True
        if end is not None and end in self.stop_ids:
            return text + self.release(), committed, True
        return text, committed, False

    def _push(self, committed: list[int]) -> tuple[str, list[int], bool]:
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

    def replay(self, delivered: list[int], *, max_new_tokens: int) -> str | None:
        """A resume: the client's tokens as if just committed (their text was streamed before).
        The turn's finish reason if they end it; tokens past its end are INVALID_ARGUMENT."""
        if not delivered:
            return None
        _, kept, hit = self.push(delivered)
        if hit:
            if len(kept) < len(delivered):
                raise InvalidArgument("delivered: tokens after the one completing a stop string")
            return STOP
        kept, finish = clip_to_stop(delivered, eos_ids=self.end_ids, remaining=max_new_tokens)
        if len(kept) < len(delivered):
            raise InvalidArgument("delivered: tokens after the end of the turn (an EOS, or max_new_tokens)")
        return finish

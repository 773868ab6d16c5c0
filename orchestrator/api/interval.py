"""The stream interval: a stream's chunks sent every `interval` tokens, not every round.

Each chunk on a Generate stream is one gRPC message, written by the
orchestrator and read by the client; at millisecond rounds and many streams
that per-message work, not the model, sets the pace. `--stream-interval N`
gathers a stream's consecutive chunks until they hold N tokens and sends them
as one: the text, the token ids and the log-probabilities joined, the first
chunk's start_index and session id. Nothing else changes:

  - the stream's first chunk goes at once (the time to the first token, and
    the session id a resume names);
  - the stats message, the end of the stream and an error flush what is held
    first (an error: what is held is not sent, and a resume regenerates it
    exactly, from the tokens the client did receive);
  - a request asking for per-round detail (round_tokens) gets every round's
    chunk: a round's detail belongs to its own chunk.

Interval 1 (the default) sends each round's chunk as it commits.
"""
from __future__ import annotations

from dataclasses import replace

from orchestrator.common.events import ChunkEvent


class ChunkGatherer:
    """One stream's chunks, gathered to `interval` tokens (see the module docstring)."""

    def __init__(self, interval: int) -> None:
        self.interval = max(1, int(interval))
        self._held: list[ChunkEvent] = []
        self._tokens = 0
        self._first = True

    def add(self, chunk: ChunkEvent) -> ChunkEvent | None:
        """The chunk to send now (this one, or those held joined with it), or None to hold it."""
        self._held.append(chunk)
        self._tokens += len(chunk.token_ids)
        if self._first or chunk.round is not None or self._tokens >= self.interval:
            self._first = False
            return self.flush()
        return None

    def flush(self) -> ChunkEvent | None:
        """What is held, as one chunk (None when nothing is)."""
        held, self._held, self._tokens = self._held, [], 0
        if len(held) <= 1:
            return held[0] if held else None
        first = held[0]
        return replace(
            first,
            text="".join(c.text for c in held),
            token_ids=[t for c in held for t in c.token_ids],
            logprobs=None if first.logprobs is None else [lp for c in held for lp in c.logprobs or ()],
        )

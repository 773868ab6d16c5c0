"""Stopping: EOS ids, max_new_tokens and stop strings.

Nothing beyond a limit is ever committed, even when a round accepted more: the
orchestrator passes each round's new tokens through clip_to_stop before
committing them, and each text delta through a StopStringHoldback before
streaming it.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

EOS = "eos"
LENGTH = "length"
STOP = "stop"


def clip_to_stop(
    tokens: Sequence[int], *, eos_ids: Collection[int], remaining: int
) -> tuple[list[int], str | None]:
    """Cut a round's new tokens at the first EOS and at `remaining` (max_new_tokens left).

    The EOS token itself IS committed (it is part of the target's sequence, counts
    toward max_new_tokens, and keeps the committed ids identical to plain
    generation); the caller simply does not stream its text. Returns
    (tokens to commit, finish reason): "eos" if an EOS was committed, else "length"
    if the limit was reached (exactly or by cutting), else None.
    """
    committed: list[int] = []
    for token in tokens:
        if len(committed) >= remaining:
            break
        committed.append(int(token))
        if token in eos_ids:
            return committed, EOS
    if len(committed) >= remaining:
        return committed, LENGTH
    return committed, None


class StopStringHoldback:
    """Streams text while holding back anything that could be the start of a stop string.

    push(delta) returns (text safe to emit now, stop hit). Text from a stop
    string on is never emitted; after a hit every later push returns ("", True).
    A held-back tail that could still begin a stop string waits for more text;
    flush() releases it when generation ends without a hit. With `include` the stop string
    itself is emitted too (vLLM's include_stop_str_in_output); text after it never is.
    """

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.include = include
        self._held = ""
        self.hit: str | None = None  # the stop string that ended generation

    def push(self, text: str) -> tuple[str, bool]:
        if self.hit is not None:
            return "", True
        buf = self._held + text
        first = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self._held = ""
            self.hit = first[1]
            return buf[: first[0] + (len(first[1]) if self.include else 0)], True
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release held-back text (call at the end when no stop string was hit)."""
        out, self._held = self._held, ""
        return out

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

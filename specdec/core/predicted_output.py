"""Predicted Outputs: where the committed output stands in a caller's prediction.

The prediction (e.g. the file being edited) is proposed token by token while
the output follows it. After a rejection the output has diverged; the cursor
then re-aligns: the last few committed tokens (the longest n-gram, `max_ngram`
down to `min_ngram`) are looked up in the prediction, first at or after the
place where the output last followed it (an edit usually leaves the rest of
the text in order), else anywhere, and proposing goes on after the match.
With no match the round proposes nothing and the next one tries again.

The lookup goes through a `PredictionIndex`, built once per request (off the
event loop: orchestrator.api.servicer): every n-gram's starts, sorted, so a
realignment costs a few binary searches whatever the prediction's length.

The cursor is fed the committed tokens in order and its proposals are a pure
function of them, so a retried or resumed turn proposes the same tokens.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

_KEY_BITS = 63  # an n-gram's tokens packed into one int64 key, when they fit


class PredictionIndex:
    """A prediction's n-grams (n = min_ngram..max_ngram), each with its starts in ascending order."""

    def __init__(self, prediction: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.tokens = [int(t) for t in prediction]
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        array = np.asarray(self.tokens, dtype=np.int64)
        top = int(array.max()) if array.size else 0
        self._bits = max(1, top.bit_length())
        packed = array.size == 0 or int(array.min()) >= 0
        self._tables = {n: self._sorted(array, n) if packed and n * self._bits <= _KEY_BITS
                        else self._dict(n) for n in range(min_ngram, max_ngram + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def _sorted(self, array: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys sorted, the start of each): a stable sort keeps equal n-grams' starts ascending."""
        count = max(0, len(array) - n + 1)
        keys = np.zeros(count, dtype=np.int64)
        for j in range(n):
            keys = (keys << self._bits) | array[j:j + count]
        order = np.argsort(keys, kind="stable")
        return keys[order], order

    def _dict(self, n: int) -> dict[tuple[int, ...], list[int]]:
        """n-gram -> its starts, for tokens that do not pack into one key (a huge vocabulary)."""
        table: dict[tuple[int, ...], list[int]] = {}
        for start in range(len(self.tokens) - n + 1):
            table.setdefault(tuple(self.tokens[start:start + n]), []).append(start)
        return table

    def _starts(self, gram: Sequence[int]):
        """The starts of `gram` in the prediction, ascending (empty if it does not occur)."""
        table = self._tables[len(gram)]
        if isinstance(table, dict):
            return table.get(tuple(gram), ())
        keys, order = table
        if any(not 0 <= t < (1 << self._bits) for t in gram):
            return ()  # a token no n-gram here holds (and that would not pack)
        key = 0
        for t in gram:
            key = (key << self._bits) | int(t)
        lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        return order[lo:hi]

    def find(self, gram: Sequence[int], anchor: int) -> int | None:
        """The index after an occurrence of `gram`: the first one ending at or after `anchor`, else
        the first one; None if it does not occur."""
        starts = self._starts(gram)
        if len(starts) == 0:
            return None
        n = len(gram)
        i = bisect_left(starts, anchor - n)
        return int(starts[i] if i < len(starts) else starts[0]) + n


class PredictedOutputCursor:
    def __init__(self, prediction: Sequence[int] | PredictionIndex, max_ngram: int = 3,
                 min_ngram: int = 1) -> None:
        index = prediction if isinstance(prediction, PredictionIndex) else \
            PredictionIndex(prediction, max_ngram, min_ngram)
        self.index = index
        self.prediction = index.tokens
        self.max_ngram, self.min_ngram = index.max_ngram, index.min_ngram
        self.output: list[int] = []  # the committed output fed so far
        self.position: int | None = 0  # index of the next predicted token; None = diverged
        self.anchor = 0  # where the output last followed the prediction

    def __len__(self) -> int:
        return len(self.output)

    def extend(self, tokens: Sequence[int]) -> None:
        """Feed newly committed output tokens."""
        for token in tokens:
            self.output.append(token)
            pos = self.position
            if pos is not None and pos < len(self.prediction) and self.prediction[pos] == token:
                self.position = self.anchor = pos + 1
            else:
                self.position = self._realign()

    def propose(self, k: int) -> list[int]:
        """Up to k predicted tokens after the output so far (none while diverged)."""
        if self.position is None or k <= 0:
            return []
        return self.prediction[self.position : self.position + k]

    def _realign(self) -> int | None:
        """The index after the latest n-gram of the output found in the prediction, or None."""
        out = self.output
        for n in range(min(self.max_ngram, len(out)), self.min_ngram - 1, -1):
            found = self.index.find(out[-n:], self.anchor)
            if found is not None:
                return found
        return None

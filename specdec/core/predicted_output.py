"""Predicted Outputs: where the committed output stands in a caller's prediction.

The prediction (e.g. the file being edited) is proposed token by token while
the output follows it. After a rejection the output has diverged; the cursor
then re-aligns: the last few committed tokens (the longest n-gram, `max_ngram`
down to `min_ngram`) are looked up in the prediction, first at or after the
place where the output last followed it (an edit usually leaves the rest of
the text in order), else anywhere, and proposing goes on after the match.
With no match the round proposes nothing and the next one tries again.

The cursor is fed the committed tokens in order and its proposals are a pure
function of them, so a retried or resumed turn proposes the same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence


class PredictedOutputCursor:
    def __init__(self, prediction: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.prediction = list(prediction)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
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
        pred, out = self.prediction, self.output
        for n in range(min(self.max_ngram, len(out)), self.min_ngram - 1, -1):
            gram = out[-n:]
            later = before = None
            for start in range(0, len(pred) - n + 1):
                if pred[start : start + n] == gram:
                    if start + n >= self.anchor:
                        later = start + n
                        break
                    if before is None:
                        before = start + n
            found = later if later is not None else before
            if found is not None:
                return found
        return None

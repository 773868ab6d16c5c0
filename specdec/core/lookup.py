"""Prompt lookup: propose the tokens that followed the last n-gram's most recent earlier occurrence.

The rule (as in prompt-lookup decoding): take the last `max_ngram` committed
tokens, find their most recent earlier occurrence, and propose up to
`num_tokens` tokens that followed it; if there is none, try shorter n-grams down
to `min_ngram`; if nothing matches, propose nothing (the round is an ordinary
target pass). No model, ~free, strong when the output copies the input
(rewriting, editing code, quoting).

`PromptLookup` keeps one dict per n-gram size from n-gram to the end of its
most recent occurrence, updated as tokens are committed, so a proposal costs a
few dict lookups however long the history is.
"""
from __future__ import annotations

from collections.abc import Sequence


def _check_sizes(max_ngram: int, min_ngram: int, num_tokens: int) -> None:
    if min_ngram < 1:
        raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
    if max_ngram < min_ngram:
        raise ValueError(f"max_ngram must be >= min_ngram ({min_ngram}), got {max_ngram}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")


class PromptLookup:
    """Incremental prompt lookup over a growing committed history.

    extend() costs O(new tokens * n-gram sizes); propose() costs O(n-gram sizes
    + num_tokens), independent of the history length.
    """

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1, num_tokens: int = 6) -> None:
        _check_sizes(max_ngram, min_ngram, num_tokens)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_tokens = num_tokens
        self._tokens: list[int] = []
        # n -> {n-gram: exclusive end of its most recent indexed occurrence}.
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        # Occurrences ending at positions < _indexed_to are in the index. The
        # one ending at the last token is kept out, so a lookup of the suffix
        # finds an *earlier* occurrence.
        self._indexed_to = 0

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index every n-gram that now has a successor."""
        self._tokens.extend(int(t) for t in tokens)
        toks = self._tokens
        first = max(self._indexed_to, 1)
        stop = len(toks)  # index n-grams ending (exclusively) at first..len-1
        for n, table in self._index.items():
            # Ascending `end`, so a later occurrence overwrites an earlier one.
            for end in range(max(first, n), stop):
                table[tuple(toks[end - n : end])] = end
        self._indexed_to = max(self._indexed_to, stop)

    def propose(self, limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) tokens; [] when no n-gram matches."""
        count = self.num_tokens if limit is None else min(self.num_tokens, max(limit, 0))
        toks = self._tokens
        length = len(toks)
        if count == 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length < n + 1:
                continue
            end = self._index[n].get(tuple(toks[length - n :]))
            if end is not None:
                return toks[end : end + count]
        return []

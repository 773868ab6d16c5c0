"""Prompt lookup: propose the tokens that followed the last n-gram's most recent earlier occurrence.

The rule (as in prompt-lookup decoding): take the last `max_ngram` committed
tokens, find their most recent earlier occurrence, and propose up to
`num_tokens` tokens that followed it; if there is none, try shorter n-grams down
to `min_ngram`; if nothing matches, propose nothing (the round is an ordinary
target pass). No model, ~free, strong when the output copies the input
(rewriting, editing code, quoting).

`PromptLookup` keeps one dict per n-gram size from n-gram to the ends of its
most recent occurrences, updated as tokens are committed, so a proposal costs a
few dict lookups however long the history is. `propose_tree` merges what followed
several occurrences into a token tree (a trie: the continuations share their
common prefixes and branch where they differ), for a target that verifies trees.
"""
from __future__ import annotations

from collections.abc import Sequence

RECENT = 4  # occurrences kept per n-gram for token trees


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
        # n -> {n-gram: the ends of its RECENT latest occurrences, oldest first} (token trees).
        self._recent: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
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
            recent = self._recent[n]
            for end in range(max(first, n), stop):
                key = tuple(toks[end - n : end])
                table[key] = end
                ends = recent.setdefault(key, [])
                ends.append(end)
                if len(ends) > RECENT:
                    del ends[0]
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

    def propose_tree(self, limit: int, nodes: int, width: int) -> tuple[list[int], list[int]]:
        """A token tree of what followed up to `width` recent occurrences of the last n-gram
        (longest n-grams first, the most recent first): (tokens, parents), parents first, each
        parent an earlier index or -1, at most `nodes` tokens, `limit` deep. The first
        continuation is propose(limit)'s chain; the others branch where they differ from it."""
        toks, length = self._tokens, len(self._tokens)
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        seen: set[int] = set()  # an occurrence of a longer n-gram is one of the shorter too
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length < n + 1:
                continue
            for end in reversed(self._recent[n].get(tuple(toks[length - n :]), [])):
                if len(seen) == width or len(tokens) >= nodes:
                    return tokens, parents
                if end in seen:
                    continue
                seen.add(end)
                parent = -1
                for token in toks[end : end + min(limit, self.num_tokens)]:
                    node = children.get((parent, token))
                    if node is None:
                        if len(tokens) >= nodes:
                            break
                        node = children[(parent, token)] = len(tokens)
                        tokens.append(token)
                        parents.append(parent)
                    parent = node
        return tokens, parents

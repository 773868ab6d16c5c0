"""Prompt lookup on literal token arrays, and the incremental index against the reference scan."""
from __future__ import annotations

import random
import time

import pytest

from specdec.core.lookup import PromptLookup

WORDS: dict[str, int] = {}


def lookup(tokens: list[int], max_ngram: int = 2, min_ngram: int = 1, num_tokens: int = 6) -> list[int]:
    """Reference by direct scan (O(len(tokens)) per call), for the incremental index to match.

    For n from max_ngram down to min_ngram: if the last n tokens occur earlier
    (an occurrence ending before the last token), return up to num_tokens of
    the tokens that followed the most recent such occurrence.
    """
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # exclusive end of a candidate occurrence
            if tokens[end - n : end] == suffix:
                return tokens[end : end + num_tokens]
    return []


def ids(text: str) -> list[int]:
    """Whitespace 'tokenizer': a fixed id per distinct word (ids stand in for BPE tokens)."""
    return [WORDS.setdefault(w, len(WORDS)) for w in text.split()]


def words(tokens: list[int]) -> str:
    rev = {v: k for k, v in WORDS.items()}
    return " ".join(rev[t] for t in tokens)


def incremental(tokens: list[int], chunks: int = 3, **kw) -> list[int]:
    pl = PromptLookup(**kw)
    step = max(1, len(tokens) // chunks)
    for i in range(0, len(tokens), step):
        pl.extend(tokens[i : i + step])
    return pl.propose()


def test_rewrite_copies_the_mat_and() -> None:
    history = ids("Rewrite politely : the cat sat on the mat and ate my lunch . Rewritten : a cat sat on")
    assert words(lookup(history, num_tokens=3)) == "the mat and"
    assert words(incremental(history, num_tokens=3)) == "the mat and"
    assert words(lookup(history)) == "the mat and ate my lunch"  # default N = 6


def test_nothing_when_last_tokens_never_occurred() -> None:
    history = ids("one two three four five six")
    assert lookup(history) == []
    assert incremental(history) == []
    assert PromptLookup().propose() == []


def test_falls_back_to_one_token_and_prefers_most_recent() -> None:
    # "zeta" never followed "omega" before, but "zeta" alone occurred twice: the latest wins.
    history = ids("zeta a b zeta c d omega zeta")
    assert words(lookup(history, num_tokens=2)) == "c d"
    assert words(incremental(history, num_tokens=2)) == "c d"
    # With min_ngram = 2 there is no fallback.
    assert lookup(history, min_ngram=2) == []
    assert incremental(history, min_ngram=2) == []


def test_two_gram_beats_more_recent_one_gram() -> None:
    history = ids("x y FIRST q y SECOND x y")
    assert words(lookup(history, num_tokens=1)) == "FIRST"  # "x y" matched, not the later "y"
    assert words(incremental(history, num_tokens=1)) == "FIRST"


def test_limit_and_end_of_history() -> None:
    pl = PromptLookup(num_tokens=6)
    pl.extend(ids("p q r p q"))
    assert words(pl.propose()) == "r p q"  # only what followed exists
    assert words(pl.propose(limit=2)) == "r p"
    assert pl.propose(limit=0) == []


def test_incremental_equals_reference_scan() -> None:
    rnd = random.Random(0)
    for trial in range(300):
        vocab = rnd.choice([3, 5, 20])
        seq = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 60))]
        kw = dict(max_ngram=rnd.choice([1, 2, 3]), min_ngram=1, num_tokens=rnd.choice([1, 4, 6]))
        kw["min_ngram"] = rnd.randint(1, kw["max_ngram"])
        pl = PromptLookup(**kw)
        for i in range(len(seq)):
            pl.extend(seq[i : i + 1])
            assert pl.propose() == lookup(seq[: i + 1], **kw), (seq[: i + 1], kw)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookup(num_tokens=-1)


def test_cost_stays_flat_as_history_grows() -> None:
    rnd = random.Random(1)
    pl = PromptLookup()
    pl.extend([rnd.randrange(5000) for _ in range(20_000)])

    def per_round() -> float:
        """The fastest of 5 batches of 40 rounds: a pause of the shared machine (another process,
        a collection) lengthens one batch, not all five, so it does not count as cost."""
        batches = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(40):
                pl.propose()
                pl.extend([rnd.randrange(5000), rnd.randrange(5000)])
            batches.append((time.perf_counter() - start) / 40)
        return min(batches)

    at_20k = per_round()
    pl.extend([rnd.randrange(5000) for _ in range(80_000)])
    at_100k = per_round()
    # Generous bounds: the CI machine is shared, but a rescan would be ~1000x slower.
    assert at_20k < 1e-3 and at_100k < 1e-3
    assert at_100k < 10 * at_20k + 1e-4

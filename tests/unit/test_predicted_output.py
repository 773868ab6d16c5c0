"""Predicted Outputs' cursor (specdec.core.predicted_output) and the per-choice seeds (n > 1)."""
from __future__ import annotations

import pytest

from specdec.core.predicted_output import PredictedOutputCursor, PredictionIndex
from specdec.core.rng import choice_seed


def test_follows_the_prediction_while_the_output_does():
    cursor = PredictedOutputCursor([1, 2, 3, 4, 5])
    assert cursor.propose(3) == [1, 2, 3]
    cursor.extend([1, 2])
    assert cursor.propose(8) == [3, 4, 5]
    cursor.extend([3, 4, 5])
    assert cursor.propose(2) == []  # the prediction is spent


def test_realigns_after_an_edit():
    # "the cat sat on the mat" predicted; the output writes "dog" for "cat".
    the, cat, dog, sat, on, mat = 10, 11, 12, 13, 14, 15
    cursor = PredictedOutputCursor([the, cat, sat, on, the, mat])
    cursor.extend([the, dog])
    assert cursor.propose(4) == []  # "dog" is nowhere in the prediction
    cursor.extend([sat])
    assert cursor.propose(4) == [on, the, mat]


def test_realigns_forward_from_where_the_output_last_followed():
    a, b, c, x, y = 1, 2, 3, 8, 9
    # "a b" occurs twice; after the edit at the second occurrence's end the cursor must not
    # jump back to the first one.
    cursor = PredictedOutputCursor([a, b, c, a, b, y, c])
    cursor.extend([a, b, c, a, b, x])
    assert cursor.propose(4) == []
    cursor.extend([c])
    assert cursor.propose(4) == []  # past the end: "c" after the anchor is the last token
    cursor = PredictedOutputCursor([a, b, c, a, b, y, c, a])
    cursor.extend([a, b, c, a, b, x, c])
    assert cursor.propose(4) == [a]


def test_a_deletion_skips_ahead_and_an_insertion_waits():
    cursor = PredictedOutputCursor([1, 2, 3, 4, 5, 6, 7])
    cursor.extend([1, 2, 5])  # 3, 4 deleted
    assert cursor.propose(3) == [6, 7]
    cursor = PredictedOutputCursor([1, 2, 3, 4, 5])
    cursor.extend([1, 2, 9, 9])  # inserted text
    assert cursor.propose(3) == []
    cursor.extend([3])
    assert cursor.propose(3) == [4, 5]


def test_proposals_are_a_function_of_the_tokens_fed():
    prediction, output = [5, 6, 7, 5, 6, 8, 9], [5, 6, 9, 5, 6, 8, 1, 9]
    one = PredictedOutputCursor(prediction)
    one.extend(output)
    other = PredictedOutputCursor(prediction)
    for t in output:
        other.extend([t])
    assert one.propose(5) == other.propose(5) and one.position == other.position


def test_bad_ngram_sizes():
    with pytest.raises(ValueError):
        PredictedOutputCursor([1], max_ngram=1, min_ngram=2)


def test_choice_seeds():
    assert choice_seed(1234, 0) == 1234  # choice 0 is the n = 1 answer
    seeds = [choice_seed(1234, i) for i in range(64)]
    assert len(set(seeds)) == 64 and 0 not in seeds
    assert seeds == [choice_seed(1234, i) for i in range(64)]  # a pure function
    assert choice_seed(1235, 1) != choice_seed(1234, 1)
    assert all(0 < choice_seed(2**64 - 1, i) < 2**64 for i in range(1, 8))


def test_choice_specs_and_the_merged_stream():
    import asyncio

    from orchestrator.api.choices import choice_requests, merged as _merged
    from orchestrator.common.request import TurnRequest
    from specdec.core.sampling import SamplingParams

    spec = TurnRequest(prompt_ids=(1, 2), max_new_tokens=4, sampling=SamplingParams(), seed=0)
    assert choice_requests(spec, 1) == [spec]
    specs = choice_requests(spec, 3)
    assert [s.index for s in specs] == [0, 1, 2] and specs[0].seed  # one random seed, drawn once
    assert [s.seed for s in specs[1:]] == [choice_seed(specs[0].seed, i) for i in (1, 2)]

    async def choice(name: str, n: int, fail: bool = False):
        for i in range(n):
            await asyncio.sleep(0)
            yield f"{name}{i}"
        if fail:
            raise RuntimeError(f"{name} failed")

    async def collect(*streams):
        return [r async for r in _merged(list(streams))]

    out = asyncio.run(collect(choice("a", 3), choice("b", 2)))
    assert sorted(out) == ["a0", "a1", "a2", "b0", "b1"]
    assert [x for x in out if x[0] == "a"] == ["a0", "a1", "a2"]  # each choice in order
    cancelled = []

    async def endless(tag: str):
        try:
            while True:
                await asyncio.sleep(0)
                yield tag
        finally:
            cancelled.append(tag)  # the other choices are stopped (their KV freed)

    async def fails_and_checks():
        # Three endless choices fill the queue (2 per stream): some wait to hand a response
        # over when the failure comes; every one is closed before the error reaches the caller.
        with pytest.raises(RuntimeError, match="b failed"):
            await collect(endless("x"), endless("y"), endless("z"), choice("b", 2, fail=True))
        assert sorted(cancelled) == ["x", "y", "z"]

    asyncio.run(fails_and_checks())


def _scanned(prediction, output, max_ngram=3, min_ngram=1):
    """The cursor's rule by a full scan of the prediction for every token (the reference)."""
    position, anchor = 0, 0
    for i, token in enumerate(output):
        if position is not None and position < len(prediction) and prediction[position] == token:
            position = anchor = position + 1
            continue
        position, out = None, output[:i + 1]
        for n in range(min(max_ngram, len(out)), min_ngram - 1, -1):
            starts = [s for s in range(len(prediction) - n + 1) if prediction[s:s + n] == out[-n:]]
            later = [s + n for s in starts if s + n >= anchor]
            if starts:
                position = later[0] if later else starts[0] + n
                break
    return position


@pytest.mark.parametrize("seed", range(40))
def test_the_index_proposes_what_a_full_scan_finds(seed):
    import random

    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 50, 2**20, 2**40])  # 2**40: n-grams too wide to pack into one key
    prediction = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
    output = []
    while len(output) < 80:  # follows the prediction for a while, edits, jumps, invents
        r = rng.random()
        if r < 0.5 and prediction:
            start = rng.randrange(len(prediction))
            output += prediction[start:start + rng.randrange(1, 8)]
        else:
            output.append(rng.randrange(vocab + 2))
    for max_ngram, min_ngram in ((3, 1), (2, 2), (4, 1)):
        cursor = PredictedOutputCursor(prediction, max_ngram, min_ngram)
        for i, token in enumerate(output):
            cursor.extend([token])
            assert cursor.position == _scanned(prediction, output[:i + 1], max_ngram, min_ngram)


def test_realigning_costs_nothing_like_the_predictions_length():
    import time

    # 1M tokens the output never follows: a scan per token would take minutes for 600 tokens.
    prediction = [(7 * i) % 30011 for i in range(1_000_000)]
    index = PredictionIndex(prediction)
    started = time.perf_counter()
    cursor = PredictedOutputCursor(index)
    for t in range(600):
        cursor.extend([40_000 + t])  # nowhere in the prediction
        assert cursor.propose(4) == []
    cursor.extend([7, 14])  # found again (a token's first occurrence after the anchor)
    assert cursor.propose(2) == [21, 28]
    assert time.perf_counter() - started < 2.0

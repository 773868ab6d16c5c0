"""EOS / max_new_tokens clipping and stop-string hold-back."""
from __future__ import annotations

import random

import pytest

from specdec.core.stopping import StopStringHoldback, clip_to_stop


@pytest.mark.parametrize(
    "tokens,eos,remaining,want",
    [
        ([1, 2, 3], {9}, 10, ([1, 2, 3], None)),
        ([1, 2, 3], {2}, 10, ([1, 2], "eos")),  # EOS kept, later tokens dropped
        ([1, 2, 3], {9}, 2, ([1, 2], "length")),  # never beyond the limit
        ([1, 2, 3], {9}, 3, ([1, 2, 3], "length")),
        ([1, 2, 3], {3}, 3, ([1, 2, 3], "eos")),
        ([1, 2, 3], {3}, 2, ([1, 2], "length")),
        ([1, 2, 3], {1, 2}, 10, ([1], "eos")),
        ([1, 2, 3], set(), 0, ([], "length")),
        ([], {1}, 5, ([], None)),
    ],
)
def test_clip_to_stop(tokens, eos, remaining, want) -> None:
    assert clip_to_stop(tokens, eos_ids=eos, remaining=remaining) == want


def stream(stop: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    h = StopStringHoldback(stop)
    emitted: list[str] = []
    hit = False
    for d in deltas:
        out, hit = h.push(d)
        emitted.append(out)
        if hit:
            break
    if not hit:
        emitted.append(h.flush())
    return "".join(emitted), hit, emitted


def test_partial_stop_string_is_held_back() -> None:
    text, hit, parts = stream(["</end>"], ["Hello </", "en", "d> world"])
    assert (text, hit) == ("Hello ", True)
    assert parts[0] == "Hello "  # "</" held back
    text, hit, parts = stream(["</end>"], ["Hello </", "en", "joy"])
    assert (text, hit) == ("Hello </enjoy", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    assert stream(["BBB", "AB"], ["xxAB", "BB"])[:2] == ("xx", True)
    assert stream(["\n\n", "User:"], ["Sure.\n", "\nUser: hi"])[:2] == ("Sure.", True)


def test_after_a_hit_nothing_more() -> None:
    h = StopStringHoldback(["stop"])
    assert h.push("a stop b") == ("a ", True)
    assert h.push("more") == ("", True)
    assert h.hit == "stop"


def test_no_stop_strings_streams_everything() -> None:
    assert stream([], ["a", "b"]) == ("ab", False, ["a", "b", ""])


def test_random_streams_never_leak_a_stop_string() -> None:
    rnd = random.Random(0)
    for _ in range(500):
        stops = ["".join(rnd.choice("ab") for _ in range(rnd.randint(1, 4))) for _ in range(rnd.randint(1, 3))]
        full = "".join(rnd.choice("abc") for _ in range(rnd.randint(0, 30)))
        cuts = sorted(rnd.sample(range(len(full) + 1), k=min(len(full) + 1, rnd.randint(0, 6))))
        deltas = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)])]
        text, hit, _ = stream(stops, deltas)
        first = min((full.find(s) for s in stops if s in full), default=-1)
        if first >= 0:
            assert hit and text == full[:first]
        else:
            assert not hit and text == full


def test_bad_stop_strings() -> None:
    with pytest.raises(ValueError):
        StopStringHoldback([""])
    with pytest.raises(TypeError):
        StopStringHoldback("stop")  # type: ignore[arg-type]

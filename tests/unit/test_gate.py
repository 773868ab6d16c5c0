"""orchestrator.gate: drafting allowed only where it measured faster, per load level."""
from __future__ import annotations

from orchestrator.gate import SpeculationGate, load_level


def _run(gate: SpeculationGate, epochs: int, rate: dict[bool, float], t0: float = 100.0) -> list[bool]:
    """`epochs` epochs; each commits rate[mode] tokens/s; the modes the gate ran, in order."""
    modes, now = [], t0
    for _ in range(epochs):
        spec = gate.allows(now)
        modes.append(spec)
        gate.record(int(rate[spec] * gate.epoch_s))
        now += gate.epoch_s
    gate.allows(now)  # closes the last epoch
    return modes


def test_levels_are_powers_of_two() -> None:
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6, 7]


def test_slower_drafting_is_switched_off_and_still_measured_now_and_then() -> None:
    gate = SpeculationGate()
    gate.enter()
    modes = _run(gate, 40, {True: 80.0, False: 100.0})
    assert modes[:2] == [True, False]  # each mode measured once, drafting first
    later = modes[2:]
    assert 1 <= later.count(True) <= len(later) // gate.explore_every + 1  # only the exploration epochs
    spec, plain, _ = gate.snapshot()[1]
    assert abs(spec - 80.0) < 1 and abs(plain - 100.0) < 1


def test_faster_drafting_stays_on() -> None:
    gate = SpeculationGate()
    gate.enter()
    modes = _run(gate, 40, {True: 130.0, False: 100.0})
    assert modes.count(False) <= 1 + 40 // gate.explore_every


def test_drafting_must_beat_plain_by_the_margin() -> None:
    gate = SpeculationGate(margin=0.05)
    gate.enter()
    modes = _run(gate, 24, {True: 102.0, False: 100.0})
    assert modes[2:].count(True) <= len(modes[2:]) // gate.explore_every + 1


def test_each_load_level_has_its_own_verdict() -> None:
    gate = SpeculationGate()
    gate.enter()
    _run(gate, 10, {True: 130.0, False: 100.0})  # alone: drafting pays
    for _ in range(15):
        gate.enter()  # 16 sessions
    modes = _run(gate, 20, {True: 300.0, False: 400.0}, t0=1000.0)
    assert modes[1] is False and modes[2:].count(True) <= 20 // gate.explore_every + 1
    levels = gate.snapshot()
    assert levels[1][0] > levels[1][1] and levels[5][0] < levels[5][1]
    for _ in range(15):
        gate.leave()
    assert _run(gate, 3, {True: 130.0, False: 100.0}, t0=5000.0)[1:] == [True, True]  # alone again


def test_a_changed_verdict_is_logged_once_with_its_rates(caplog) -> None:
    import logging

    gate = SpeculationGate(name="10.0.0.7:50061")
    for _ in range(6):
        gate.enter()  # six live sessions: the 5-8 level
    with caplog.at_level(logging.INFO, logger="orchestrator.gate"):
        _run(gate, 20, {True: 80.0, False: 100.0})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["target 10.0.0.7:50061, 5-8 live session(s): no drafting (k = 0) "
                     "(measured 80.0 tokens/s drafting, 100.0 without)"]

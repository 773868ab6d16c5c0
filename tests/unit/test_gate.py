"""orchestrator.policy.gate: drafting allowed only where it measured faster, per load level."""
from __future__ import annotations

from orchestrator.policy.gate import STALE_FACTOR, SpeculationGate, load_level


ROUNDS = 10  # decoding rounds per session in each epoch of _run


def _run(gate: SpeculationGate, epochs: int, rate: dict[bool, float], t0: float = 100.0) -> list[bool]:
    """`epochs` epochs; the replica commits rate[mode] tokens/s in each; the modes the gate ran, in order."""
    modes, now = [], t0
    for _ in range(epochs):
        spec = gate.allows(now)
        modes.append(spec)
        live = max(gate.live, 1)
        for _ in range(ROUNDS):  # each live session: ROUNDS rounds filling the epoch, its share of the rate
            for _ in range(live):
                gate.record(rate[spec] * gate.epoch_s / live / ROUNDS, gate.epoch_s / ROUNDS)
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
    with caplog.at_level(logging.INFO, logger="orchestrator.policy.gate"):
        _run(gate, 20, {True: 80.0, False: 100.0})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["target 10.0.0.7:50061, 5-8 live session(s): no drafting (k = 0) "
                     "(measured 80.0 tokens/s drafting, 100.0 without)"]


def test_a_verdict_that_explorations_confirm_is_measured_less_and_less_often() -> None:
    gate = SpeculationGate()
    gate.enter()
    modes = _run(gate, 200, {True: 80.0, False: 100.0})
    explorations = modes[2:].count(True)
    # Waits of 8, 16 and then 32 epochs: 9 explorations in 198 epochs (a fixed 1-in-8: 24).
    assert 3 <= explorations <= 10
    gaps = [i for i, spec in enumerate(modes) if spec][1:]
    assert gaps[-1] - gaps[-2] == gate.explore_max  # one exploring epoch in the longest wait


def test_a_changed_verdict_restarts_the_exploration_schedule() -> None:
    gate = SpeculationGate()
    gate.enter()
    _run(gate, 120, {True: 80.0, False: 100.0})  # long confirmed: explorations every 32 epochs
    modes = _run(gate, 60, {True: 200.0, False: 100.0}, t0=1000.0)  # the text got easy: drafting pays
    first_on = modes.index(True)
    assert first_on <= gate.explore_max + 1
    later = modes[first_on + 4:]
    assert later.count(True) >= len(later) - len(later) // gate.explore_every - 1  # drafting, mostly


def test_a_new_load_level_above_a_plain_one_starts_without_drafting() -> None:
    gate = SpeculationGate()
    for _ in range(4):
        gate.enter()  # 3-4 sessions: drafting measured slower
    _run(gate, 6, {True: 80.0, False: 100.0})
    for _ in range(4):
        gate.enter()  # 8 sessions: a level not seen yet
    modes = _run(gate, 12, {True: 80.0, False: 100.0}, t0=1000.0)
    # Plain from the start; drafting first measured at the level's first exploration.
    assert modes[:gate.explore_every] == [False] * gate.explore_every
    assert True in modes and gate.snapshot()[4][0] is not None


def test_a_small_drafting_lead_below_presumes_plain_decoding_one_level_up() -> None:
    def first_modes(lead: float) -> list[bool]:
        gate = SpeculationGate()
        gate.enter()
        gate.enter()  # 2 sessions: drafting measured ahead by `lead`
        _run(gate, 6, {True: 100.0 * lead, False: 100.0})
        gate.enter()
        gate.enter()  # 4 sessions: a level not seen yet
        return _run(gate, 4, {True: 90.0, False: 100.0}, t0=1000.0)

    assert first_modes(1.15) == [False] * 4  # a narrow lead: plain until the first exploration
    assert first_modes(1.6) == [True, False, False, False]  # a clear one: drafting measured first


def test_an_exploring_epoch_is_shorter_than_a_chosen_one() -> None:
    gate = SpeculationGate()
    gate.enter()
    modes = _run(gate, 12, {True: 80.0, False: 100.0})  # plain chosen; one exploration so far
    assert modes[2:].count(True) == 1
    lengths, now = [], 1000.0
    start, mode = None, None
    while len(lengths) < 2 * gate.explore_every:  # step through time; note each epoch's length
        spec = gate.allows(now)
        gate.record(4.0 if spec else 5.0, 0.05)  # 80 tokens/s drafting, 100 without, as before
        if spec != mode or gate._epoch_start != start:
            if start is not None:
                lengths.append((mode, round(now - start, 2)))
            start, mode = gate._epoch_start, spec
        now += 0.05
    explored = [length for spec, length in lengths[1:] if spec]
    chosen = [length for spec, length in lengths[1:] if not spec]
    # Each closes at the first 50 ms step past its length: half an epoch, against a whole one.
    assert explored and all(0.5 <= x <= 0.56 for x in explored), lengths
    assert chosen and all(1.0 <= x <= 1.06 for x in chosen), lengths


def test_a_new_load_level_below_a_drafting_one_starts_with_drafting() -> None:
    gate = SpeculationGate()
    for _ in range(8):
        gate.enter()
    _run(gate, 6, {True: 130.0, False: 100.0})  # 5-8 sessions: drafting pays
    for _ in range(6):
        gate.leave()  # 2 sessions
    modes = _run(gate, 10, {True: 130.0, False: 100.0}, t0=1000.0)
    assert modes[:gate.explore_every] == [True] * gate.explore_every


def test_an_epoch_is_scored_on_its_rounds_time_not_on_the_wall_clock() -> None:
    """Time outside the recorded rounds (a prompt's prefill, a client reading, an idle replica)
    does not count against the epoch's mode: one 0.3 s round of 3 tokens scores 10 tokens/s,
    as its wall clock's second would score 3."""
    gate = SpeculationGate(min_rounds=1)
    gate.enter()
    assert gate.allows(10.0) is True
    gate.record(3, 0.3)
    assert gate.allows(11.0) is False  # drafting measured; plain next
    gate.record(8, 1.0)
    gate.allows(12.0)
    spec, plain, epochs = gate.snapshot()[1]
    assert abs(spec - 10.0) < 1e-9 and abs(plain - 8.0) < 1e-9 and epochs == 2
    assert gate.mode_spec is True  # 10 > 8 x (1 + margin): drafting chosen


def test_a_rate_is_the_replica_s_rounds_times_its_live_sessions() -> None:
    gate = SpeculationGate(min_rounds=1)
    for _ in range(4):
        gate.enter()
    gate.allows(10.0)
    for _ in range(4):  # four concurrent sessions, each 2 tokens in a 0.5 s round
        gate.record(2, 0.5)
    gate.allows(11.0)
    assert abs(gate.snapshot()[3][0] - 16.0) < 1e-9  # 4 tokens/s per session x 4


def test_an_epoch_without_a_recorded_round_is_not_scored() -> None:
    gate = SpeculationGate()
    gate.enter()
    gate.allows(10.0)
    gate.allows(11.0)  # only a prefill ran (not recorded)
    assert gate.snapshot().get(1, (None, None, 0))[2] == 0


def test_one_freak_epoch_does_not_flip_a_clear_verdict() -> None:
    """Plain decoding measured clearly better; then one plain epoch at a third of its rate (the
    replica stalled): the verdict stands. A lasting change still flips it."""
    gate = SpeculationGate()
    gate.enter()
    _run(gate, 10, {True: 80.0, False: 100.0})
    assert gate.snapshot()[1][1] > 95.0
    modes = _run(gate, 1, {True: 80.0, False: 33.0}, t0=500.0)
    assert modes == [False]
    spec, plain, _ = gate.snapshot()[1]
    assert plain > spec * (1 + gate.margin)  # 100 -> 85 at most, not 80
    modes = _run(gate, 30, {True: 80.0, False: 40.0}, t0=600.0)  # plain decoding really got slow
    assert modes[-10:].count(True) >= 8


def test_a_burst_of_sessions_ends_a_drafting_epoch_at_once_where_their_level_measured_plain() -> None:
    gate = SpeculationGate()
    for _ in range(16):
        gate.enter()
    _run(gate, 6, {True: 300.0, False: 400.0})  # 9-16 sessions: plain decoding measured faster
    for _ in range(15):
        gate.leave()
    _run(gate, 6, {True: 130.0, False: 100.0}, t0=1000.0)  # one session: drafting pays
    levels_before = gate.snapshot()
    now = 2000.0
    assert gate.allows(now) is True  # a lone session's epoch: drafting
    gate.record(10, 0.1)
    for i in range(15):  # a burst arrives within the epoch
        gate.enter()
        # 2-8 sessions: no verdict there (drafting alone, plain at 9-16), so the epoch runs on;
        # at 9 the level that measured plain is reached and the epoch ends.
        assert gate.allows(now + 0.01 * (i + 1)) is (load_level(gate.live) < 5), gate.live
    assert gate.allows(now + 0.5) is False  # still within the first epoch's second: plain already
    assert gate.snapshot() == levels_before  # the cut-short epoch was not scored


def test_a_fall_in_load_keeps_the_running_epoch_s_mode_until_it_ends() -> None:
    gate = SpeculationGate()
    gate.enter()
    _run(gate, 6, {True: 130.0, False: 100.0})  # alone: drafting pays
    for _ in range(15):
        gate.enter()
    _run(gate, 6, {True: 300.0, False: 400.0}, t0=1000.0)  # 16 sessions: plain
    now = 2000.0
    assert gate.allows(now) is False
    for i in range(16):
        gate.record(2.0, 0.05, f"s{i}")  # the epoch's first decoding round, at 16 sessions
    for _ in range(15):
        gate.leave()  # the streams finish, one remains
    assert gate.allows(now + 0.5) is False  # mid-epoch: no switch
    assert gate.allows(now + 1.0) is True  # the next epoch runs the lone session's verdict


def test_a_burst_is_scored_at_its_own_level_though_its_first_arrival_started_the_epoch() -> None:
    """Two requests arriving together: the first one's round starts an epoch at one live session,
    the second joins before any decoding round, and the epoch starts again at two (the level its
    rounds run at). It is scored there, so two seconds of such a load measure both modes there
    (drafting first, with one session's clear lead below it, then plain)."""
    gate = SpeculationGate()
    gate.enter()
    _run(gate, 4, {True: 150.0, False: 100.0})  # one session: drafting measured 50% ahead
    gate.leave()
    now = 500.0  # the replica sat idle; then a burst of two
    gate.enter()
    first = gate.allows(now)  # the first arrival's prefill round: a new epoch, at one session
    gate.enter()
    assert gate.allows(now + 0.01) is first  # the second's: the same epoch
    modes = [first]
    for step in range(1, 42):  # 2 s of decoding rounds, 50 ms each, both sessions
        now = 500.0 + 0.05 * step
        modes.append(gate.allows(now))
        for _ in range(2):
            gate.record(4.0 if modes[-1] else 3.0, 0.05)  # 80 vs 60 tokens/s a session
    gate.allows(now + 0.05)
    spec, plain, epochs = gate.snapshot()[2]
    assert epochs == 2 and spec is not None and plain is not None
    # Drafting first (the epoch restarted at 500.01, so its second ends at 501.01), then plain.
    assert modes[:21] == [True] * 21 and modes[21:41] == [False] * 20


def _two_sessions(gate: SpeculationGate, epochs: int, t0: float, rates: dict[bool, tuple[float, float]],
                  keyed: bool = True) -> list[bool]:
    """`epochs` epochs of two sessions, 20 rounds of 50 ms each per epoch; rates[mode] = the two
    sessions' tokens/s in that mode. The modes the gate ran, in order."""
    modes, now = [], t0
    for _ in range(epochs):
        spec = gate.allows(now)
        modes.append(spec)
        for _ in range(20):
            for i, rate in enumerate(rates[spec]):
                gate.record(rate * 0.05, 0.05, f"s{i}" if keyed else None)
        now += gate.epoch_s
    gate.allows(now)
    return modes


def test_drafting_that_leaves_one_session_slower_than_plain_decoding_is_switched_off() -> None:
    """Two sessions: drafting runs one at 52 tokens/s and the other at 33, plain decoding both at
    37. Summed, drafting leads (85 against 74); the two requests end with the slower one, which
    drafting left behind plain decoding: plain is chosen. Pooled (no session named), the same
    rounds would choose drafting."""
    rates = {True: (52.0, 33.0), False: (37.0, 37.0)}
    gate = SpeculationGate()
    gate.enter()
    gate.enter()
    modes = _two_sessions(gate, 20, 100.0, rates)
    spec, plain, _ = gate.snapshot()[2]
    assert abs(spec - 66.0) < 1 and abs(plain - 74.0) < 1  # the slowest session's rate x 2
    assert modes[2:].count(True) <= len(modes[2:]) // gate.explore_every + 1
    pooled = SpeculationGate()
    pooled.enter()
    pooled.enter()
    modes = _two_sessions(pooled, 20, 100.0, rates, keyed=False)
    assert modes[2:].count(False) <= len(modes[2:]) // pooled.explore_every + 1


def test_drafting_that_speeds_up_every_session_stays_on() -> None:
    gate = SpeculationGate()
    gate.enter()
    gate.enter()
    modes = _two_sessions(gate, 20, 100.0, {True: (60.0, 45.0), False: (37.0, 37.0)})
    assert modes[2:].count(False) <= len(modes[2:]) // gate.explore_every + 1
    assert abs(gate.snapshot()[2][0] - 90.0) < 1


def test_a_session_with_too_few_rounds_in_the_epoch_is_not_its_slowest() -> None:
    """A session that joined at the epoch's end (one round, one token in 100 ms) does not set the
    epoch's rate: the others' slowest does."""
    gate = SpeculationGate()
    gate.enter()
    gate.enter()
    gate.allows(10.0)
    for _ in range(10):
        gate.record(2, 0.05, "a")  # 40 tokens/s
        gate.record(3, 0.05, "b")  # 60 tokens/s
    gate.record(1, 0.1, "late")
    gate.allows(11.0)
    assert abs(gate.snapshot()[2][0] - 80.0) < 1e-9  # 40 x 2 live


def test_an_epoch_with_too_few_rounds_runs_on_until_it_has_them() -> None:
    """A lone request that starts late in an epoch (another request's warm-up started it): at the
    epoch's end it has 2 decoding rounds, its first draft calls, slow ones. The epoch runs on
    until it holds MIN_EPOCH_ROUNDS, and is scored on them all: drafting, 50% faster once under
    way, is chosen. Scored on the two rounds, it lost to plain decoding."""
    def lone_request(gate: SpeculationGate) -> list[bool]:
        gate.enter()
        modes, now = [gate.allows(10.0)], 10.0
        now = 10.9  # the request's first decoding rounds: its first draft calls, 0.05 s each
        for tokens in (1, 1):
            gate.record(tokens, 0.05)
            now += 0.05
            modes.append(gate.allows(now))
        for _ in range(60):  # then drafting under way: 3 tokens a 0.05 s round (60/s), plain 40/s
            spec = modes[-1]
            gate.record(3 if spec else 2, 0.05)
            now += 0.05
            modes.append(gate.allows(now))
        return modes

    gate = SpeculationGate()
    modes = lone_request(gate)
    spec, plain, epochs = gate.snapshot()[1]
    assert epochs >= 2 and spec > plain * (1 + gate.margin), gate.snapshot()
    assert modes[-1] is True and modes.count(False) <= 25  # one plain epoch, then drafting
    # The control: scored on whatever the epoch held (the rule off), the two slow rounds decide.
    hasty = SpeculationGate(min_rounds=1)
    modes = lone_request(hasty)
    spec, plain, _ = hasty.snapshot()[1]
    assert spec < plain and modes[-1] is False


def test_an_epoch_past_its_staleness_bound_is_not_scored_even_with_too_few_rounds() -> None:
    gate = SpeculationGate()
    gate.enter()
    gate.allows(10.0)
    gate.record(3, 0.05)
    assert gate.allows(12.0) is True  # 2 s: still waiting for rounds
    gate.allows(10.0 + STALE_FACTOR * gate.epoch_s + 0.1)  # gone stale: closed, unscored
    assert gate.snapshot().get(1, (None, None, 0))[2] == 0


def _bursts(gate: SpeculationGate, bursts: int, rate: dict[bool, float], n: int = 16) -> list[list[bool]]:
    """`bursts` bursts of `n` requests arriving together: each session's prefill round as it
    arrives, 16 decoding rounds of 50 ms each (the replica commits rate[mode] tokens/s), every
    session done at once, 0.3 s idle (a burst and its gap outlast an epoch, so each epoch started
    by a burst's first arrival closes at the next one's), the next burst. The modes of each burst's
    decoding rounds."""
    now, out = 100.0, []
    for _ in range(bursts):
        for i in range(n):
            gate.enter()
            gate.allows(now + 0.001 * i)  # its prefill round (not recorded)
        now += 0.05
        modes = []
        for _ in range(16):
            spec = gate.allows(now)
            modes.append(spec)
            for i in range(n):
                gate.record(rate[spec] * 0.05 / n, 0.05, f"s{i}")
            now += 0.05
        for _ in range(n):
            gate.leave()
        now += 0.3
        out.append(modes)
    return out


def test_bursts_that_drain_and_start_again_are_scored_at_their_level() -> None:
    """A load of synchronized bursts (all its requests start, and end, together): each epoch
    starts at a burst's first arrival and closes at the next one's, with one session live. It
    runs the mode of the level its rounds run at and is scored there, so the level learns that
    plain decoding is faster and stops drafting. Run, as it was, in the mode of one session's
    level and scored at the level live when it closed, no epoch was scored and every burst drafted."""
    gate = SpeculationGate()
    modes = _bursts(gate, 12, {True: 300.0, False: 400.0})
    spec, plain, epochs = gate.snapshot()[load_level(16)]
    assert spec is not None and plain is not None and epochs >= 3
    assert plain > spec
    assert not any(modes[-1])  # settled on plain decoding,
    assert sum(map(sum, modes[2:])) <= 10  # drafting after the first two bursts: one exploration (half an epoch)
    faster = _bursts(SpeculationGate(), 12, {True: 500.0, False: 400.0})  # the control: drafting pays
    assert all(faster[-1]) and sum(map(sum, faster[2:])) >= 16 * 9


def test_a_load_that_moved_to_another_level_for_most_of_the_epoch_is_not_scored() -> None:
    """The rule's other side: an epoch whose rounds ran mostly at another level than its first
    round's (16 sessions, then 2 for most of it) scores nothing, at either level."""
    gate = SpeculationGate()
    for _ in range(16):
        gate.enter()
    gate.allows(100.0)
    for i in range(16):
        gate.record(1.0, 0.05, f"s{i}")  # one round at 16 live
    for _ in range(14):
        gate.leave()
    for _ in range(30):  # 30 rounds at 2 live
        for i in range(2):
            gate.record(1.0, 0.05, f"s{i}")
    gate.allows(101.1)
    assert all(epochs == 0 for _, _, epochs in gate.snapshot().values())

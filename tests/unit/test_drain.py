"""specdec.runtime.drain: the drain of a model service, on its own (no server)."""
from __future__ import annotations

import asyncio
import time

import pytest

from specdec.runtime.drain import Drain, Draining

METHOD = "/specdec.v1.TargetService/Score"


def test_an_idle_replica_is_drained_at_once(monkeypatch) -> None:
    slept: list[float] = []  # counted in sleeps, not seconds: an idle drain waits out no quiet period
    sleep = asyncio.sleep

    async def recorded(delay, *args, **kwargs):
        slept.append(delay)
        return await sleep(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    drain = Drain([METHOD], quiet_s=0.5)
    drain.begin()
    assert asyncio.run(drain.wait(5.0)) is True
    assert slept == []


def test_a_recent_call_is_waited_on_for_the_quiet_period_and_a_call_in_flight_to_its_end() -> None:
    async def scenario() -> tuple[float, float, int]:
        drain = Drain([METHOD], quiet_s=0.3)
        drain._enter(METHOD)  # a call in flight
        drain.begin()
        t0 = time.monotonic()  # before the refusal: the quiet period ends 0.3 s after it at the soonest
        with pytest.raises(Draining):
            drain._enter(METHOD)  # a new one is refused (and counts as a call: the quiet restarts)
        waiter = asyncio.ensure_future(drain.wait(5.0))
        await asyncio.sleep(0.2)
        assert not waiter.done()  # the call in flight holds the drain
        drain._exit()
        settled = await waiter
        return settled, time.monotonic() - t0, drain.refused

    settled, took, refused = asyncio.run(scenario())
    assert settled is True and refused == 1
    # The refusal began a 0.3 s quiet period (the call ended at 0.2 s); settled long before the 5 s deadline.
    assert 0.3 <= took < 2.0


def test_the_deadline_bounds_the_drain() -> None:
    drain = Drain([METHOD], quiet_s=0.1)
    drain._enter(METHOD)  # never finishes
    drain.begin()
    assert asyncio.run(drain.wait(0.2)) is False

"""specdec.runtime.drain: the drain of a model service, on its own (no server)."""
from __future__ import annotations

import asyncio
import time

import pytest

from specdec.runtime.drain import Drain, Draining

METHOD = "/specdec.v1.TargetService/Score"


def test_an_idle_replica_is_drained_at_once() -> None:
    drain = Drain([METHOD], quiet_s=0.5)
    drain.begin()
    t0 = time.monotonic()
    assert asyncio.run(drain.wait(5.0)) is True
    assert time.monotonic() - t0 < 0.1


def test_a_recent_call_is_waited_on_for_the_quiet_period_and_a_call_in_flight_to_its_end() -> None:
    async def scenario() -> tuple[float, float, int]:
        drain = Drain([METHOD], quiet_s=0.3)
        drain._enter(METHOD)  # a call in flight
        drain.begin()
        with pytest.raises(Draining):
            drain._enter(METHOD)  # a new one is refused (and counts as a call: the quiet restarts)
        t0 = time.monotonic()
        waiter = asyncio.ensure_future(drain.wait(5.0))
        await asyncio.sleep(0.2)
        assert not waiter.done()  # the call in flight holds the drain
        drain._exit()
        settled = await waiter
        return settled, time.monotonic() - t0, drain.refused

    settled, took, refused = asyncio.run(scenario())
    assert settled is True and refused == 1
    assert 0.28 <= took < 1.0  # the refusal at t0 began a 0.3 s quiet period; the call ended at 0.2 s


def test_the_deadline_bounds_the_drain() -> None:
    drain = Drain([METHOD], quiet_s=0.1)
    drain._enter(METHOD)  # never finishes
    drain.begin()
    assert asyncio.run(drain.wait(0.2)) is False

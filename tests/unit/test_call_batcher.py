"""orchestrator.fleet.batching: the wire framing and the gathering policy, with a recording sender."""
from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from orchestrator.fleet.batching import CallBatcher, Late, Overlap, frame
from specdec.v1 import model_pb2


def test_framed_items_are_the_batch_message_protobuf_writes() -> None:
    items = [model_pb2.ScoreRequest(session_id=f"s{i}", tokens=list(range(i * 50)), k=i) for i in range(4)]
    ours = b"".join(frame(item.SerializeToString()) for item in items)
    assert ours == model_pb2.ScoreBatchRequest(items=items).SerializeToString()
    assert list(model_pb2.ScoreBatchRequest.FromString(ours).items) == items


def batcher_timers(method=CallBatcher._flush) -> list[float]:
    """The delays of the timers the batchers set on the running loop from now on for `method`
    (their waits, by default; the senders' own sleeps are not counted): a wait is told by its
    timer, not by the clock."""
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    call_later = loop.call_later

    def recorded(delay, callback, *args, **kwargs):
        if getattr(callback, "__func__", None) is method:
            delays.append(delay)
        return call_later(delay, callback, *args, **kwargs)

    loop.call_later = recorded
    return delays


class Recorder:
    """A sender that answers each item with its payload, after `delay_s`, and records every batch."""

    def __init__(self, delay_s: float = 0.0, fail: Exception | None = None) -> None:
        self.batches: list[list[str]] = []
        self.delay_s, self.fail = delay_s, fail

    async def __call__(self, items):
        self.batches.append([item.session_id for item in items])
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return [ValueError("bad item") if item.payload == b"bad" else item.payload for item in items]


def test_a_lone_session_never_waits() -> None:
    async def main():
        sender = Recorder()
        batcher = CallBatcher(sender, max_wait_s=1.0)
        batcher._rpc_s = 1.0  # a slow replica: the wait bound would be long
        waits = batcher_timers()
        for _ in range(3):
            assert await batcher.call("solo", b"x") == b"x"
        assert waits == []  # each call went in the next turn of the loop, never on a timer
        assert sender.batches == [["solo"]] * 3

    asyncio.run(main())


def test_live_sessions_share_one_batch_and_a_late_one_waits_at_most_the_bound() -> None:
    async def main():
        sender = Recorder(delay_s=0.01)
        batcher = CallBatcher(sender, max_wait_s=0.05, wait_fraction=10.0)
        # Round 1 makes four sessions live (they arrive together: one batch of four).
        first = await asyncio.gather(*(batcher.call(f"s{i}", b"%d" % i) for i in range(4)))
        assert first == [b"0", b"1", b"2", b"3"] and sender.batches[-1] == ["s0", "s1", "s2", "s3"]
        # Round 2: three come at once, the fourth late: the three wait (bounded), then go.
        waits = batcher_timers()
        early = [asyncio.create_task(batcher.call(f"s{i}", b"x")) for i in range(3)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in early)  # waiting for s3
        late = await batcher.call("s3", b"y")
        await asyncio.gather(*early)
        assert late == b"y" and sender.batches[-1] == ["s0", "s1", "s2", "s3"]
        # Round 3: s3 is gone for good; after leave() the others no longer wait for it.
        batcher.leave("s3")
        await asyncio.gather(*(batcher.call(f"s{i}", b"z") for i in range(3)))
        assert sender.batches[-1] == ["s0", "s1", "s2"]
        assert waits and all(0 < w <= 0.05 for w in waits), waits  # never past max_wait_s

    asyncio.run(main())


def test_the_wait_is_bounded() -> None:
    async def main():
        sender = Recorder()
        batcher = CallBatcher(sender, max_wait_s=0.03, wait_fraction=100.0)
        await asyncio.gather(batcher.call("a", b"1"), batcher.call("b", b"2"))  # both live
        batcher._rpc_s = 10.0
        waits = batcher_timers()
        t0 = time.perf_counter()
        assert await batcher.call("a", b"3") == b"3"  # b never comes
        assert time.perf_counter() - t0 >= 0.02  # it did wait ...
        assert waits == [0.03]  # ... max_wait_s, not wait_fraction x 10 s

    asyncio.run(main())


def test_errors_go_to_their_own_callers() -> None:
    async def main():
        sender = Recorder()
        batcher = CallBatcher(sender, max_wait_s=0.05)
        good, bad = await asyncio.gather(batcher.call("a", b"ok"), batcher.call("b", b"bad"),
                                         return_exceptions=True)
        assert good == b"ok" and isinstance(bad, ValueError)
        down = CallBatcher(Recorder(fail=ConnectionError("replica down")), max_wait_s=0.05)
        results = await asyncio.gather(down.call("a", b"1"), down.call("b", b"2"), return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results)

    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_others_served() -> None:
    async def main():
        sender = Recorder(delay_s=0.02)
        batcher = CallBatcher(sender, max_wait_s=0.05)
        await asyncio.gather(batcher.call("a", b"1"), batcher.call("b", b"2"))
        a = asyncio.create_task(batcher.call("a", b"3"))
        b = asyncio.create_task(batcher.call("b", b"4"))
        await asyncio.sleep(0.005)
        a.cancel()
        assert await b == b"4"
        with pytest.raises(asyncio.CancelledError):
            await a

    asyncio.run(main())


def test_one_watch_timer_tells_the_late_callers_and_their_answers_still_come() -> None:
    """watch: an item unanswered at its deadline resolves to Late (its caller decides what to do),
    and its answer comes to Late.answer; an item answered in time is never told Late, and one
    timer serves every watched item (none of them sets its own)."""
    async def main():
        sender = Recorder(delay_s=0.3)
        batcher = CallBatcher(sender)
        timers = batcher_timers(CallBatcher._expire)
        slow = [batcher.submit_item(f"s{i}", f"p{i}".encode()) for i in range(8)]
        for item in slow:
            batcher.watch(item, time.monotonic() + 0.05)
        outs = await asyncio.gather(*(item.future for item in slow))
        assert all(isinstance(out, Late) for out in outs)
        assert len(timers) == 1  # eight watched items, one timer
        assert await asyncio.gather(*(out.answer for out in outs)) == [f"p{i}".encode() for i in range(8)]
        sender.delay_s = 0.0
        quick = batcher.submit_item("q", b"q")
        batcher.watch(quick, time.monotonic() + 0.2)
        assert await quick.future == b"q"  # answered in time: the answer itself
        await asyncio.sleep(0.25)  # the timer fires, finds it answered, and forgets it
        assert batcher._watched == [] and quick.late is None

    asyncio.run(main())


def test_sessions_in_flight_are_waited_for_so_cohorts_merge() -> None:
    """b goes alone; a, calling while b's batch is in flight, waits for b to come back and the
    two share every batch from then on (sent at once, a would alternate forwards with b)."""
    async def main():
        sender = Recorder(delay_s=0.1)
        batcher = CallBatcher(sender, max_wait_s=0.02)
        await asyncio.gather(batcher.call("a", b"1"), batcher.call("b", b"2"))  # both live
        batcher._rpc_s = 0.1  # the measured batch RPC time

        async def session(sid: str, rounds: int, start_s: float) -> None:
            await asyncio.sleep(start_s)
            for _ in range(rounds):
                await batcher.call(sid, b"x")

        await asyncio.gather(session("b", 4, 0.0), session("a", 3, 0.05))
        assert sender.batches[1:] == [["b"], ["a", "b"], ["a", "b"], ["a", "b"]]

    asyncio.run(main())


def test_the_wait_for_an_in_flight_session_is_bounded() -> None:
    async def main():
        sender = Recorder(delay_s=0.05)
        batcher = CallBatcher(sender, max_wait_s=0.02)
        await asyncio.gather(batcher.call("a", b"1"), batcher.call("b", b"2"))
        batcher._rpc_s = 0.05
        b = asyncio.create_task(batcher.call("b", b"3"))  # goes alone after the wait
        await asyncio.sleep(0.03)
        waits = batcher_timers()
        assert await batcher.call("a", b"4") == b"4"  # b comes back but never calls again
        assert await b == b"3"
        # b's expected return (at most one RPC time away) plus the usual bound, then alone.
        assert len(waits) == 1 and 0.02 <= waits[0] <= 0.05 + 0.02 + 1e-9, waits
        assert sender.batches[1:] == [["b"], ["a"]]

    asyncio.run(main())


class Replica:
    """A replica on its own thread (its own core) that serves one batch at a time, in order:
    `fixed_s` plus `per_item_s` per item."""

    def __init__(self, fixed_s: float, per_item_s: float) -> None:
        self.fixed_s, self.per_item_s = fixed_s, per_item_s
        self.sizes: list[int] = []
        self._busy = asyncio.Lock()

    async def __call__(self, items):
        async with self._busy:
            self.sizes.append(len(items))
            await asyncio.to_thread(time.sleep, self.fixed_s + self.per_item_s * len(items))
        return [item.payload for item in items]


async def closed_loop(batcher: CallBatcher, sessions: int, work_s: float, seconds: float) -> None:
    """`sessions` streams for `seconds`, each calling again once the orchestrator has worked
    `work_s` on its answer, holding the event loop as a round's Python does."""
    end = time.perf_counter() + seconds

    async def stream(sid: str) -> None:
        while time.perf_counter() < end:
            await batcher.call(sid, b"x")
            time.sleep(work_s)

    await asyncio.gather(*(stream(f"s{i}") for i in range(sessions)))


def served(fixed_s: float, per_item_s: float, overlap: Overlap | None, seconds: float) -> tuple[int, list[int]]:
    """Items served by the closed loop of 8 streams (the orchestrator's 1.5 ms a stream), and the
    batch sizes."""
    async def main():
        replica = Replica(fixed_s, per_item_s)
        batcher = CallBatcher(replica, max_wait_s=0.05, overlap=overlap)
        await closed_loop(batcher, 8, 0.0015, seconds)
        return replica.sizes

    sizes = asyncio.run(main())
    return sum(sizes), sizes


@pytest.mark.parametrize("fixed_s, per_item_s, cohorts, gain", [
    (0.001, 0.001, 2, 1.35),  # a forward that costs in proportion to its rows (a CPU): overlap pays
    (0.025, 0.0, 1, 0.85),  # one that costs the same at any size (a GPU, memory-bound): it does not
])
def test_overlap_chooses_the_cohorts_that_carry_more(fixed_s: float, per_item_s: float, cohorts: int,
                                                     gain: float) -> None:
    """In proportion, one cohort takes 8 x 1.5 + 1 + 8 = 21 ms a round and two max(12, 2 + 8) = 12:
    overlap serves 1.35x more or better. Flat, one takes 12 + 25 = 37 ms and two max(12, 50) = 50: it
    keeps one cohort and loses at most its trials (0.85x)."""
    overlap = Overlap("target", "test", "Score", probe_s=0.5)
    with_overlap, sizes = served(fixed_s, per_item_s, overlap, 2.5)
    without, plain = served(fixed_s, per_item_s, None, 2.5)
    assert overlap.standing == cohorts, sizes
    labels = {"role": "target", "address": "test", "method": "Score"}
    assert REGISTRY.get_sample_value("specdec_batch_cohorts", labels) == cohorts  # the standing choice
    trials = sum(REGISTRY.get_sample_value("specdec_batch_overlap_trials_total",
                                           {"role": "target", "method": "Score", "outcome": o}) or 0
                 for o in ("kept", "held", "void"))
    assert trials >= 1
    assert with_overlap >= gain * without, (with_overlap, without, sizes)
    assert sum(size == 8 for size in plain[1:-1]) >= 0.9 * len(plain[1:-1]), plain  # one batch a round

"""orchestrator.api.multiplex.Multiplexer without gRPC: how it packs, ends, fails and cancels.

Each generation here is a small async generator in place of the orchestrator's loop; the
Multiplexer under test is the real one.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.api import multiplex
from orchestrator.api.multiplex import Multiplexer
from specdec.runtime.errors import InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb


def _chunk(*ids: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.Chunk(token_ids=list(ids)))


class Rounds:
    """Generations that each commit one chunk per round, every generation in the same moment."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.tick = asyncio.Event()

    async def start(self, request: pb.GenerateRequest):
        if request.prompt == "bad":
            raise InvalidArgument("prompt: bad")
        for i in range(self.rounds if request.max_new_tokens == 0 else request.max_new_tokens):
            await self.tick.wait()
            yield _chunk(i)
        yield pb.GenerateResponse(stats=pb.Stats(new_tokens=self.rounds))

    async def clock(self, n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0.005)
            self.tick.set()
            self.tick.clear()


async def _serve(rounds: Rounds, messages, *, ticks: int, hold_open: float = 0.0) -> list[pb.GenerateManyResponse]:
    async def requests():
        for message in messages:
            yield message
        await asyncio.sleep(hold_open)

    clock = asyncio.get_running_loop().create_task(rounds.clock(ticks))
    try:
        return [r async for r in Multiplexer(rounds.start).serve(requests())]
    finally:
        clock.cancel()


def _start(gid: int, prompt: str = "p", max_new: int = 0) -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(id=gid, request=pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new))


def test_one_message_per_round_carries_every_generations_chunk():
    rounds = Rounds(rounds=5)
    out = asyncio.run(_serve(rounds, [_start(i) for i in range(1, 9)], ticks=40))
    chunks = [[e for e in r.events if e.response.HasField("chunk")] for r in out]
    per_round = [len(c) for c in chunks if c]
    # 8 generations, 5 rounds: a round's 8 chunks always share one message (a machine that stalls
    # past a tick may join two rounds in one; never split one).
    assert sum(per_round) == 40 and all(n % 8 == 0 for n in per_round), per_round
    assert len(per_round) >= 3, per_round
    ends = [e.id for r in out for e in r.events if e.end]
    assert sorted(ends) == list(range(1, 9))
    for gid in range(1, 9):  # each generation's events in its own order: chunks 0..4, stats, end
        mine = [e for r in out for e in r.events if e.id == gid]
        assert [list(e.response.chunk.token_ids) for e in mine[:5]] == [[i] for i in range(5)]
        assert mine[5].response.HasField("stats") and mine[6].end


def test_a_failing_generation_ends_alone_with_its_status():
    rounds = Rounds(rounds=3)
    out = asyncio.run(_serve(rounds, [_start(1), _start(2, "bad"), pb.GenerateManyRequest(id=3)], ticks=30))
    events = [e for r in out for e in r.events]
    failed = {e.id: e for e in events if e.code}
    assert set(failed) == {2, 3}
    assert failed[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and failed[2].message == "prompt: bad"
    assert failed[2].end and not failed[2].HasField("response")
    assert sum(e.response.HasField("chunk") for e in events if e.id == 1) == 3


def test_an_id_live_twice_is_refused_and_a_cancel_stops_its_generation():
    rounds = Rounds(rounds=1000)
    messages = [_start(1), _start(1), _start(2, max_new=3), pb.GenerateManyRequest(id=1, cancel=True)]
    out = asyncio.run(_serve(rounds, messages, ticks=20, hold_open=0.05))
    events = [e for r in out for e in r.events]
    assert [e.message for e in events if e.code] == [
        "GenerateMany: generation 1 is still live on this stream; ids are unique among live ones"]
    assert not any(e.id == 1 and e.response.HasField("chunk") for e in events)  # cancelled first
    assert any(e.id == 2 and e.end for e in events)


def test_generations_wait_for_the_caller_past_max_held(monkeypatch):
    monkeypatch.setattr(multiplex, "MAX_HELD", 4)
    rounds = Rounds(rounds=3)

    async def run():
        async def requests():
            for i in range(1, 9):
                yield _start(i)

        clock = asyncio.get_running_loop().create_task(rounds.clock(40))
        mux = Multiplexer(rounds.start)
        sizes = []
        async for response in mux.serve(requests()):
            sizes.append(len(response.events))
            await asyncio.sleep(0.02)  # a slow reader
        clock.cancel()
        return sizes, mux

    sizes, mux = asyncio.run(run())
    assert sum(sizes) == 8 * 5  # every event arrives: 3 chunks, stats and end each
    assert max(sizes) <= 8  # at most MAX_HELD, plus one event from each generation already past the wait


@pytest.mark.parametrize("turns", [1, 4])
def test_settling_is_bounded(monkeypatch, turns):
    monkeypatch.setattr(multiplex, "SETTLE_TURNS", turns)
    rounds = Rounds(rounds=2)
    out = asyncio.run(_serve(rounds, [_start(1), _start(2)], ticks=20))
    assert sum(len(r.events) for r in out) == 2 * 4

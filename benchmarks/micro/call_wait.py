"""What waiting on a round's call costs the orchestrator per call: its deadline, and the path to it.

    python -m benchmarks.micro.call_wait [--sessions 64] [--rounds 300] [--repeats 3]

`--sessions` callers each make `--rounds` calls through one real CallBatcher (orchestrator.fleet
.batching) whose batch RPC answers at once, so what is timed is the orchestrator's own work per
call (CPU of this process, best of `--repeats`), in four ways:

  bare       submit the item and await its future (no deadline: the floor)
  timer      the same under a deadline with a timer, a waiter future and two callbacks per call
             (orchestrator.fleet.remote._within, what every call paid before the batcher's watch)
  watch      the same under the batcher's one watch timer (CallBatcher.watch, Pending.within)
  item       ModelClient.score with no deadline: the ScoreRequest built and serialized, the
             batch item, the answer's Call (its cost record) made
  session    the whole of SessionReplica.call, as every round pays it: `item`, and the replica's
             health (ready, the latency book's in-flight count, the deadline, the watch, the
             answer learned)

Runs on the event loop the servers use (specdec.runtime.loop).
"""
from __future__ import annotations

import argparse
import asyncio
import time

from orchestrator.common.request import WireSampling
from orchestrator.fleet.batching import CallBatcher
from orchestrator.fleet.outliers import ReplicaHealth
from orchestrator.fleet.remote import ModelClient, SessionReplica, _within
from specdec.core.sampling import SamplingParams
from specdec.runtime import loop as event_loop
from specdec.v1 import model_pb2

WAYS = ("bare", "timer", "watch", "item", "session")
TOKENS = list(range(100, 400))


class _Router:
    def __init__(self) -> None:
        self.health = ReplicaHealth()

    async def pick(self, role, preferred="", exclude=(), *, healthy=False, room=None):
        return None


async def _answer(items) -> list:
    return [(model_pb2.ScoreResponse(argmax_ids=[7]), time.perf_counter(), 0.0) for _ in items]


def _client() -> ModelClient:
    client = ModelClient("127.0.0.1:1", "target")  # never connects: the batch RPC is replaced
    client._batcher = CallBatcher(_answer, max_wait_s=0.0)
    client._request_limit = 0
    return client


async def _caller(way: str, client: ModelClient, i: int, rounds: int) -> None:
    batcher = client.batcher
    router = _Router()
    target = SessionReplica(router, "target", f"s{i}", client, held=len(TOKENS) - 1)
    sampling = WireSampling.encode(SamplingParams())
    payload = model_pb2.ScoreRequest(session_id=f"s{i}", tokens=[1]).SerializeToString()

    def send(c: ModelClient, position: int):
        return c.score(model_pb2.ScoreRequest(session_id=f"s{i}", cache_position=position, tokens=TOKENS[position:],
                                              sampling=sampling.message))

    for _ in range(rounds):
        if way == "bare":
            await batcher.submit(f"s{i}", payload)
        elif way == "timer":
            future = batcher.submit(f"s{i}", payload)
            await _within(future, 10.0)
        elif way == "watch":
            item = batcher.submit_item(f"s{i}", payload)
            batcher.watch(item, time.monotonic() + 10.0)
            await item.future
        elif way == "item":
            await send(client, len(TOKENS) - 1)
        else:
            await target.call(send, len(TOKENS), wait_s=10.0)


async def measure(args: argparse.Namespace) -> list[str]:
    lines = [f"{args.sessions} sessions x {args.rounds} calls, one batcher answering at once; "
             f"µs of CPU per call, best of {args.repeats}:"]
    for way in WAYS:
        best = float("inf")
        for _ in range(args.repeats):
            client = _client()
            started = time.process_time()
            await asyncio.gather(*(_caller(way, client, i, args.rounds) for i in range(args.sessions)))
            best = min(best, (time.process_time() - started) / (args.sessions * args.rounds) * 1e6)
            await client.close()
        lines.append(f"  {way:8} {best:6.2f}")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro.call_wait", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--event-loop", choices=event_loop.LOOPS, default="auto")
    args = parser.parse_args(argv)
    lines = event_loop.run(measure(args), args.event_loop)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()

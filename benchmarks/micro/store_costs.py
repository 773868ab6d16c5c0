"""What the orchestrator's Redis work costs it in CPU: a session save, a registry read in a burst.

    python -m benchmarks.micro.store_costs [--redis-url redis://127.0.0.1:6379/0] [--records 8]
        [--batches 300] [--burst 64] [--repeats 3]

Every few rounds each session saves its record (specdec.runtime.store.SessionStore.save: the saves
of one event-loop turn go as one script call), and every new session reads the service registry
(ServiceRegistry.live: reads made while one is under way share it). At millisecond rounds the
CPU these take in the orchestrator's one Python thread is part of each round, so this measures it
alone, on the real Redis, under a key prefix of its own (deleted after):

  save          `--records` records (half of them kept sessions, 150 tokens each) saved in one
                event-loop turn, `--batches` times: CPU per save;
  registry      `--burst` sessions starting at once, each reading the registry: CPU per session,
                shared (as the orchestrator reads) and each its own read (what sharing saves).

CPU is this process's own (time.process_time), best of `--repeats`; the Redis server's is not
counted. Runs on the event loop the servers use (specdec.runtime.loop).
"""
from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from specdec.runtime import loop as event_loop
from specdec.runtime.store import DEFAULT_URL, ServiceEntry, ServiceRegistry, SessionRecord, SessionStore, connect


async def _best(repeats: int, times: int, count: int, run) -> float:
    """Fewest µs of CPU per item over `repeats` runs of `times` x run() (each `count` items)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(times):
            await run()
        best = min(best, (time.process_time() - started) / (times * count) * 1e6)
    return best


async def measure(args: argparse.Namespace) -> list[str]:
    client = connect(args.redis_url)
    prefix = f"specdec-bench-store-{uuid.uuid4().hex[:8]}:"
    try:
        store = SessionStore(client, url=args.redis_url, prefix=prefix)
        records = [SessionRecord(f"s{i}", tokens=tuple(range(150)), target="127.0.0.1:50051", target_len=149,
                                 turn_start=80, multi_turn=i % 2 == 0, tenant="bench")
                   for i in range(args.records)]

        async def saves() -> None:
            await asyncio.gather(*(store.save(r) for r in records))

        await saves()  # the script loaded, the connection open
        save_us = await _best(args.repeats, args.batches, len(records), saves)
        registry = ServiceRegistry(client, url=args.redis_url, prefix=prefix)
        for i in range(2):
            await registry.register(ServiceEntry(f"127.0.0.1:{50051 + i}", "target", f"t{i}"))

        async def shared() -> None:
            await asyncio.gather(*(registry.live("target") for _ in range(args.burst)))

        async def each() -> None:
            await asyncio.gather(*(registry._read_live("target") for _ in range(args.burst)))

        await each()  # the pool's connections open
        rounds = max(1, args.batches // 15)
        each_us = await _best(args.repeats, rounds, args.burst, each)
        shared_us = await _best(args.repeats, rounds, args.burst, shared)
        saves_made = store.save_batches
    finally:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    return [f"save       {save_us:8.1f} µs of CPU per save ({args.records} records a call, "
            f"{saves_made} calls)",
            f"registry   {shared_us:8.1f} µs of CPU per new session, {args.burst} at once, reads shared",
            f"           {each_us:8.1f} µs each with its own read"]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro.store_costs", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=DEFAULT_URL)
    parser.add_argument("--records", type=int, default=8, help="records saved in one event-loop turn")
    parser.add_argument("--batches", type=int, default=300, help="save calls timed per repeat")
    parser.add_argument("--burst", type=int, default=64, help="sessions reading the registry at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--event-loop", choices=event_loop.LOOPS, default="auto")
    args = parser.parse_args(argv)
    lines = event_loop.run(measure(args), args.event_loop)
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()

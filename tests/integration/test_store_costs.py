"""The store-costs micro-benchmark runs against the real Redis: saves and registry reads are timed,
and it leaves none of its keys behind."""
from __future__ import annotations

import asyncio
import re

from benchmarks.micro import store_costs
from specdec.runtime.store import connect

URL = "redis://127.0.0.1:6379/0"


def _bench_keys() -> list[bytes]:
    async def scan():
        client = connect(URL)
        keys = [k async for k in client.scan_iter(match="specdec-bench-store-*")]
        await client.aclose()
        return keys

    return asyncio.run(scan())


def test_saves_and_registry_reads_are_timed_and_cleaned_up() -> None:
    before = set(_bench_keys())
    lines = store_costs.main(["--redis-url", URL, "--records", "4", "--batches", "20", "--burst", "8",
                              "--repeats", "1"])
    save = re.match(r"save\s+([\d.]+) µs of CPU per save \(4 records a call, (\d+) calls\)", lines[0])
    shared = re.match(r"registry\s+([\d.]+) µs", lines[1])
    each = re.match(r"\s+([\d.]+) µs each with its own read", lines[2])
    assert save and shared and each, lines
    assert float(save.group(1)) > 0 and int(save.group(2)) == 21  # one script call per turn's saves
    assert float(each.group(1)) > float(shared.group(1)) > 0  # 8 reads cost more than one shared
    assert set(_bench_keys()) == before

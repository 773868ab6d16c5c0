"""python -m benchmarks.micro.engine_ops: torch operations per forward, 1 vs N sessions (torch.profiler).

Each session first holds a prompt of `--prompt` tokens; then one forward of one decode
token per session is profiled, and every operation the profiler records (aten ops and
the oneDNN products) is counted. Counting is independent of the machine's load.

  python -m benchmarks.micro.engine_ops [--tiny] [--sessions 1,4,16] [--prompt 100]
"""
from __future__ import annotations

import argparse
import json


def count_ops(runner, sessions: int, prompt: int) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.plan import RowPlan, StepPlan

    caches = []
    with torch.inference_mode():
        for i in range(sessions):
            cache = runner.new_cache()
            for start in range(0, prompt, 64):
                chunk = [5 + (i + j) % 300 for j in range(start, min(prompt, start + 64))]
                cache.reserve(cache.length + len(chunk))
                runner.logits(StepPlan([RowPlan(cache, chunk, cache.length, 0)]))
            caches.append(cache)
        rows = []
        for cache in caches:
            cache.reserve(cache.length + 1)
            rows.append(RowPlan(cache, [7], cache.length, 1))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.run(StepPlan(rows))
        for cache in caches:
            cache.free()
    return sum(e.count for e in prof.key_averages())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test target instead of the embedded one")
    parser.add_argument("--sessions", default="1,4,16")
    parser.add_argument("--prompt", type=int, default=100)
    args = parser.parse_args(argv)
    import tempfile
    from pathlib import Path

    import torch

    from engine.host import HostLimits, pick_runner
    from engine.model.loader import load

    torch.set_num_threads(1)
    spec = None
    if args.tiny:
        from tests.tiny import build_pair

        spec = str(build_pair(Path(tempfile.mkdtemp(prefix="specdec-ops-")))[0])
    counts = [int(n) for n in args.sessions.split(",")]
    runner = pick_runner(load(spec), HostLimits(max_batch=max(counts)))
    ops = {n: count_ops(runner, n, args.prompt) for n in counts}
    base = ops[counts[0]]
    for n, c in ops.items():
        print(f"{n:3d} session(s): {c} operations per forward ({c / base:.3f}x of {counts[0]})")
    print(json.dumps({"operations": ops}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

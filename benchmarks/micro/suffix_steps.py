"""How long suffix decoding's cache holds the event loop when a turn joins it.

    python -m benchmarks.micro.suffix_steps [--turns 200] [--turn-tokens 2048] [--cache-tokens 200000]

One tenant's turns (random ids over a 5,000-id vocabulary) added to a SuffixCache of the server's
default size, as the orchestrator does when a turn ends: at once (`SuffixCache.add`), and a step at
a time (`SuffixCache.adding`, what the orchestrator runs, one step per turn of its event loop).
Prints, for each, the longest time the event loop would be held and the total time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from specdec.core.suffix import CHUNK, SuffixCache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--turn-tokens", type=int, default=2048)
    p.add_argument("--cache-tokens", type=int, default=200_000)
    args = p.parse_args(argv)
    rng = random.Random(0)
    turns = [[rng.randrange(5000) for _ in range(args.turn_tokens)] for _ in range(args.turns)]
    results = {}
    for mode in ("at once", f"a step at a time ({CHUNK} tokens)"):
        cache, holds, started = SuffixCache(max_tokens=args.cache_tokens), [], time.perf_counter()
        for turn in turns:
            if mode == "at once":
                t = time.perf_counter()
                cache.add("tenant", turn)
                holds.append(time.perf_counter() - t)
            else:
                steps = cache.adding("tenant", turn)
                while True:
                    t = time.perf_counter()
                    try:
                        next(steps)
                    except StopIteration:
                        holds.append(time.perf_counter() - t)
                        break
                    holds.append(time.perf_counter() - t)
        results[mode] = (max(holds), statistics.median(holds), time.perf_counter() - started)
    print(f"{args.turns} turns of {args.turn_tokens} tokens into a {args.cache_tokens:,}-token cache:")
    print("| mode | longest hold of the loop (ms) | median hold (ms) | total (s) |")
    print("|---|---|---|---|")
    for mode, (worst, median, total) in results.items():
        print(f"| {mode} | {worst * 1e3:.1f} | {median * 1e3:.2f} | {total:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

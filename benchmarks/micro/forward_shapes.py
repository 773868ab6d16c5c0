"""python -m benchmarks.micro.forward_shapes: what exactness costs per forward shape, in-process.

The embedded target (or --tiny's) in each --dtypes, served two ways in one process, timed
interleaved: exact (the default: calibrated linears, attention as lanes) and --no-batch-invariant
(unpadded linears, one SDPA call per multi-token row). Per shape the median milliseconds of a
forward: one decode step, a Score of k + 1 = 5 tokens, 8 sessions decoding, 8 Scores of 5, and a
64-token prefill chunk, each session holding --context tokens first. Also the attention kernel
alone: one-query SDPA in bf16 against K/V upcast to fp32 (what the exact path does on a CPU).

  python -m benchmarks.micro.forward_shapes [--dtypes bfloat16,float32] [--context 120] [--reps 15] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _forward_ms(runner, shape: tuple[int, int], context: list[list[int]], reps: int) -> list[float]:
    import torch

    from engine.plan import RowPlan, StepPlan

    sessions, tokens = shape
    caches = []
    with torch.inference_mode():
        for prompt in context[:sessions]:
            cache = runner.new_cache()
            if prompt:
                cache.reserve(len(prompt))
                runner.logits(StepPlan([RowPlan(cache, prompt, 0, 1)]))
            caches.append(cache)
        times = []
        for _ in range(reps + 2):
            held = [c.length for c in caches]
            rows = []
            for cache in caches:
                cache.reserve(cache.length + tokens)
                rows.append(RowPlan(cache, [5 + i for i in range(tokens)], cache.length, tokens))
            started = time.perf_counter()
            runner.logits(StepPlan(rows))
            times.append((time.perf_counter() - started) * 1e3)
            for cache, length in zip(caches, held):
                cache.crop(length)
        for cache in caches:
            cache.free()
    return times[2:]


def sdpa_us(dtype, lanes: int, keys: int, reps: int = 50) -> tuple[float, float]:
    """One-query SDPA over `lanes` lanes of `keys` keys (SmolLM2's 9 heads, 3 KV heads, 64 wide):
    in `dtype`, and with K/V upcast to float32 (the upcast included)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(lanes, 9, 1, 64).to(dtype)
    k, v = torch.randn(lanes, 3, keys, 64).to(dtype), torch.randn(lanes, 3, keys, 64).to(dtype)
    mask = torch.ones(lanes, 1, 1, keys, dtype=torch.bool)

    def plain():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def upcast():
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=True).to(dtype)

    out = []
    for fn in (plain, upcast):
        for _ in range(3):
            fn()
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - started) / reps * 1e6)
    return out[0], out[1]


SHAPES = {"decode x1": (1, 1), "score5 x1": (1, 5), "decode x8": (8, 1), "score5 x8": (8, 5), "prefill64 x1": (1, 64)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--context", type=int, default=120, help="tokens each session holds first")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import random
    import tempfile
    from pathlib import Path

    import torch

    from engine.host import HostLimits, pick_runner
    from engine.model.loader import load

    torch.set_num_threads(1)
    spec = None
    if args.tiny:
        from tests.tiny import build_pair

        spec = str(build_pair(Path(tempfile.mkdtemp(prefix="specdec-shapes-")))[0])
    report = {}
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        runners = {"exact": pick_runner(load(spec, dtype=dtype), HostLimits(require_exact=True)),
                   "no-batch-invariant": pick_runner(load(spec, dtype=dtype), HostLimits(batch_invariant=False))}
        vocab = runners["exact"].forward.head.vocab
        rng = random.Random(0)
        context = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(8)]
        samples = {(name, shape): [] for name in runners for shape in SHAPES}
        for _ in range(3):  # interleaved rounds
            for shape, dims in SHAPES.items():
                for name, runner in runners.items():
                    ctx = [[] for _ in context] if shape.startswith("prefill") else context
                    samples[(name, shape)] += _forward_ms(runner, dims, ctx, args.reps // 3 + 1)
        rows = {shape: {name: statistics.median(samples[(name, shape)]) for name in runners} for shape in SHAPES}
        report[dtype] = rows
        print(f"\n{dtype}, {args.context} tokens held per session, median ms per forward:")
        print(f"  {'shape':<14}{'exact':>10}{'no-batch-invariant':>20}{'exact / other':>15}")
        for shape, r in rows.items():
            print(f"  {shape:<14}{r['exact']:>10.2f}{r['no-batch-invariant']:>20.2f}"
                  f"{r['exact'] / r['no-batch-invariant']:>15.2f}")
    print("\none-query SDPA, microseconds per call (bf16 in bf16 | K/V upcast to fp32):")
    kernel = {}
    for lanes, keys in ((1, 128), (5, 128), (40, 128), (64, 256)):
        plain, upcast = sdpa_us(torch.bfloat16, lanes, keys)
        kernel[f"{lanes}x{keys}"] = {"bf16": plain, "fp32_upcast": upcast}
        print(f"  {lanes:>3} lanes x {keys:>3} keys: {plain:8.0f} | {upcast:8.0f}  ({plain / upcast:.1f}x)")
    report["sdpa_one_query_us"] = kernel
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

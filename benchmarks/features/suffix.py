"""Suffix decoding on workloads that repeat themselves: requests in a row, each proposer beside
target-only, on one stack (target + draft + orchestrator, one torch thread per process).

Workloads (greedy, chat template, `--requests` each, in order):

  extract   JSON extraction: one instruction and output schema, a different record each time
  edits     multi-turn edits of one file: the same module with one line changed per request,
            each request asking for the whole file back with one more change

Configurations, interleaved per request (the order rotated): target-only (proposer none), lookup
(prompt lookup, k = 8), suffix (its own length, k <= 16) and the default (the orchestrator's
proposer: suffix decoding among its free sources). Suffix and the default each run on an
orchestrator of their own (one cache each), so each sees its own earlier requests (in a row, as
a workload does), never another configuration's answer to the same request. Identity: every configuration's tokens against
target-only's. Over the last `--measure` requests of each workload: tokens per target pass, and
tokens/s as a ratio to target-only's.

  python -m benchmarks.features.suffix [--requests 24] [--measure 16] [--max-new-tokens 64]
                                       [--workloads extract,edits] [--tiny] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.stack import Stack, StackSpec, prepare_run

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"target-only": dict(proposer="none"), "lookup-k8": dict(proposer="lookup", k=8),
           "suffix": dict(proposer="suffix"), "default": dict()}
LEARNS = ("suffix", "default")  # configurations whose proposers learn across requests (suffix's cache)
PEOPLE = [("Ada Lovelace", 36, "London", "mathematician"), ("Alan Turing", 41, "Wilmslow", "logician"),
          ("Grace Hopper", 85, "Arlington", "admiral"), ("Edsger Dijkstra", 72, "Nuenen", "professor"),
          ("Barbara Liskov", 84, "Boston", "professor"), ("Donald Knuth", 86, "Stanford", "author"),
          ("Margaret Hamilton", 88, "Boston", "engineer"), ("John Backus", 82, "Ashland", "engineer"),
          ("Frances Allen", 88, "Schenectady", "researcher"), ("Ken Thompson", 81, "Berkeley", "engineer"),
          ("Dennis Ritchie", 70, "Berkeley Heights", "engineer"), ("Niklaus Wirth", 89, "Zurich", "professor")]
FILE = [
    "def total(items):",
    "    result = 0",
    "    for item in items:",
    "        result += item.price * item.count",
    "    return result",
    "",
    "def average(items):",
    "    if not items:",
    "        return 0",
    "    return total(items) / len(items)",
]
EDITS = ["rename `result` to `acc`", "add a docstring to `total`", "rename `items` to `lines`",
         "use `sum` in `total`", "add type hints", "rename `average` to `mean`",
         "return 0.0 for an empty list", "rename `item` to `line`"]


def extract_workload(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        name, age, city, job = PEOPLE[i % len(PEOPLE)]
        record = f"{name} is a {age}-year-old {job} who lives in {city}."
        out.append([{"role": "user", "content": "Extract the person as JSON with the keys name, age, city "
                     f"and occupation, and nothing else.\nText: {record}"}])
    return out


def edits_workload(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        lines = list(FILE)
        lines[3] = f"        result += item.price * item.count  # revision {i + 1}"
        code = "\n".join(lines)
        out.append([{"role": "user", "content": f"Here is a Python file:\n```python\n{code}\n```\n"
                     f"Please {EDITS[i % len(EDITS)]} and show the whole file."}])
    return out


WORKLOADS = {"extract": extract_workload, "edits": edits_workload}


def run(addresses: dict[str, str], prompts: list[list[dict]], max_new: int, names: list[str]) -> dict[str, list[dict]]:
    """Each request under every configuration (rotated order), each through its orchestrator:
    tokens, seconds, target passes."""
    from client import Client

    records: dict[str, list[dict]] = {name: [] for name in names}
    clients = {name: Client(addresses[name], timeout=600) for name in names}
    try:
        for i, messages in enumerate(prompts):
            for name in names[i % len(names):] + names[: i % len(names)]:
                started = time.perf_counter()
                done = clients[name].complete(messages=messages, max_new_tokens=max_new, **CONFIGS[name])
                records[name].append({"tokens": list(done.token_ids), "s": time.perf_counter() - started,
                                      "passes": done.stats.target_passes, "proposer": done.stats.proposer})
            print(f"  request {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            client.close()
    return records


def summarize(records: dict[str, list[dict]], measure: int) -> list[dict]:
    base = records["target-only"]
    last = slice(len(base) - measure, None)
    base_tps = sum(len(r["tokens"]) for r in base[last]) / sum(r["s"] for r in base[last])
    rows = []
    for name, recs in records.items():
        tail = recs[last]
        tokens = sum(len(r["tokens"]) for r in tail)
        tps = tokens / sum(r["s"] for r in tail)
        rows.append({"config": name, "identical": sum(r["tokens"] == b["tokens"] for r, b in zip(recs, base)),
                     "requests": len(recs), "tokens_per_pass": tokens / max(1, sum(r["passes"] for r in tail)),
                     "tokens_per_s": tps, "vs_target_only": tps / base_tps,
                     "first_requests_tokens_per_pass": _per_pass(recs[: len(recs) - measure])})
    return rows


def _per_pass(recs: list[dict]) -> float | None:
    return sum(len(r["tokens"]) for r in recs) / sum(r["passes"] for r in recs) if recs else None


def report(results: dict[str, list[dict]], args) -> str:
    lines = [f"# Suffix decoding on repetitive workloads ({args.requests} requests in a row, greedy, "
             f"{args.max_new_tokens} new tokens; figures over the last {args.measure})", "",
             "| workload | configuration | identical to target-only | tokens per target pass (first "
             f"{args.requests - args.measure} → last {args.measure}) | tokens/s | vs target-only |",
             "|---|---|---|---|---|---|"]
    for workload, rows in results.items():
        for r in rows:
            first = r["first_requests_tokens_per_pass"]
            lines.append(f"| {workload} | {r['config']} | {r['identical']}/{r['requests']} | "
                         f"{first if first is None else f'{first:.2f}'} → {r['tokens_per_pass']:.2f} | "
                         f"{r['tokens_per_s']:.1f} | {r['vs_target_only']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--measure", type=int, default=16, help="figures over the last N requests")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--configs", default=",".join(CONFIGS), help="of %(default)s; target-only always runs "
                   "(the reference)")
    p.add_argument("--tiny", action="store_true", help="tiny random models (tests.tiny.build_pair)")
    p.add_argument("--target", help="target --model; default: the embedded one")
    p.add_argument("--draft", help="draft --model; default: the draft service's own")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "suffix")
    args = p.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    names = ["target-only", *(c.strip() for c in args.configs.split(",") if c.strip() not in ("", "target-only"))]
    if unknown := [c for c in names if c not in CONFIGS]:
        p.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if not 0 < args.measure <= args.requests:
        p.error("--measure must be between 1 and --requests")
    workdir = prepare_run(args, "specdec-suffix-")
    results = {}
    with Stack(StackSpec(target=args.target, draft=args.draft, draft_layers=None, threads=args.threads,
                         redis_url=args.redis_url, log_dir=workdir, suffix_cache_tokens=None)) as stack:
        stack.start(with_link=False)
        # A configuration that learns across requests gets an orchestrator (a cache) of its own: it
        # sees its own earlier requests only, never another configuration's answer to this one.
        addresses = {name: stack.orchestrator_address for name in names}
        for name in LEARNS:
            if name in names:
                addresses[name] = stack.start_orchestrator(stack.target_address, stack.draft_address,
                                                           f"orchestrator-{name}")
        for workload in workloads:
            print(f"{workload}: {args.requests} requests x {len(names)} configurations", file=sys.stderr)
            records = run(addresses, WORKLOADS[workload](args.requests), args.max_new_tokens, names)
            results[workload] = summarize(records, args.measure)
    text = report(results, args)
    print(text)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"results": results, "args": {
        k: str(v) for k, v in vars(args).items()}}, indent=1))
    mismatched = [(w, r["config"]) for w, rows in results.items() for r in rows if r["identical"] != r["requests"]]
    if mismatched:
        print(f"NOT identical to target-only: {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

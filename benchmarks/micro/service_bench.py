"""Service overheads on the embedded default target (SmolLM2-135M-Instruct).

    python -m benchmarks.micro.service_bench [--reps 40] [--threads 2] [--json out.json]

Measures, interleaved and as medians over --reps repetitions, after a prompt
prefill so every call appends to the same cached prefix (each call crops back
to it, so all repetitions see the same cache length):
  a) Score of 5 new tokens vs Score of 1, through gRPC (goal: ratio <= 1.5x);
  b) a 1-token Score through gRPC vs the same call in-process (target_service.scoring.score
     in this process, same model, same thread count): the difference is what
     gRPC, serialisation and the event-loop hop cost (goal: <= 2 ms);
  c) the default draft (early exit: first 2 of 30 layers) 1-token forward vs
     the full target's, in-process, and a Propose(k=4) through gRPC;
  d) the transport alone, where compute noise cannot hide it: GetInfo round
     trip, and a 1-token Score on the tiny test target (forward < 1 ms) minus
     its server-side total time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIVE, ONE = [11, 22, 33, 44, 55], [11]  # the new tokens of a 5-token and of a 1-token Score


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _transport(args: argparse.Namespace, env: dict, log_dir: Path) -> dict:
    """Per-call gRPC cost on the tiny target, whose forward is too small to add noise."""
    import grpc

    from specdec.runtime import procs
    from specdec.core.fingerprint import fingerprint
    from tests.tiny import build_model
    from specdec.v1 import common_pb2, model_pb2, model_pb2_grpc

    model_dir = build_model(log_dir / "tiny-target")
    port = procs.free_port()
    proc = procs.start(["python", "-m", "target_service", "--model", str(model_dir), "--port",
                        str(port), "--threads", str(args.threads)], env=env,
                       log_path=log_dir / "tiny.log")
    try:
        procs.wait_healthy(f"127.0.0.1:{port}", proc, timeout=120)
        stub = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        prompt = [5] * 37
        stub.Score(model_pb2.ScoreRequest(session_id="t", tokens=prompt), timeout=60)
        h = fingerprint(prompt)
        info, rtt, total, fwd = [], [], [], []
        for _ in range(max(args.reps * 5, 100)):
            t0 = time.perf_counter()
            stub.GetInfo(common_pb2.GetInfoRequest(), timeout=60)
            info.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reply = stub.Score(model_pb2.ScoreRequest(
                session_id="t", cache_position=37, prefix_hash=h, tokens=[11]), timeout=60)
            rtt.append(time.perf_counter() - t0)
            total.append(reply.timing.total_ms)
            fwd.append(reply.timing.forward_ms)
    finally:
        procs.stop(proc)
    return {
        "getinfo_rtt_ms": _median_ms(info),
        "tiny_score_rtt_ms": _median_ms(rtt),
        "tiny_server_total_ms": statistics.median(total),
        "tiny_server_forward_ms": statistics.median(fwd),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, service and in-process (1: on a shared 2-core box, 2 threads spin-wait badly)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    import torch

    from specdec.runtime import procs
    from engine.model import loader
    from engine.host import HostLimits, ModelHost

    torch.set_num_threads(args.threads)
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-service-bench-"))
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = []
    host = None
    try:
        ports = _start_services(args, env, log_dir, started)
        full = loader.load(None)
        early = loader.load(None, num_layers=2)
        # The in-process twin: the same host the service runs (batching worker
        # included), driven from one event loop of our own.
        # (a copy of its own: the host switches its model to the row-wise attention)
        host = ModelHost(loader.load(None), HostLimits())
        probes = _Probes(ports, full.tokenizer, host)
        probes.prefill()
        s = probes.series(args.reps, full.model, early.model)
        figures = _figures(s, probes.n, args)
        figures.update(_transport(args, env, log_dir))
    finally:
        for proc in started:
            procs.stop(proc)
        if host is not None:
            host.shutdown()
    _print(figures, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def _start_services(args: argparse.Namespace, env: dict, log_dir: Path, started: list) -> dict[str, int]:
    """The embedded target and the default draft, healthy; their processes go into `started`."""
    from specdec.runtime import procs

    ports = {}
    for role in ("target", "draft"):
        ports[role] = procs.free_port()
        started.append(procs.start(
            ["python", "-m", f"{role}_service", "--port", str(ports[role]),
             "--threads", str(args.threads)], env=env, log_path=log_dir / f"{role}.log"))
    for role, proc in zip(("target", "draft"), started):
        procs.wait_healthy(f"127.0.0.1:{ports[role]}", proc, timeout=600)
    return ports


class _Probes:
    """The timed calls, each appending to the same cached prompt prefix and cropped back to it:
    Score and Propose through gRPC, the same Score in-process, and raw 1-token forwards."""

    def __init__(self, ports: dict[str, int], tok, host) -> None:
        import grpc

        from model_service.requests import ModelRequest
        from specdec.core.fingerprint import fingerprint
        from specdec.core.sampling import SamplingParams
        from specdec.v1 import model_pb2_grpc
        from target_service.scoring import ScoreWork

        self.target = model_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{ports['target']}"))
        self.draft = model_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{ports['draft']}"))
        self.host = host
        self.loop = asyncio.new_event_loop()
        self.prompt = tok(tok.apply_chat_template(
            [{"role": "user", "content": "Explain speculative decoding in two sentences."}],
            add_generation_prompt=True, tokenize=False))["input_ids"]
        self.n = len(self.prompt)
        self.h = fingerprint(self.prompt)
        self.greedy = SamplingParams()
        self.caches = {}
        self._work, self._request = ScoreWork, ModelRequest  # looked up here, not inside a timed call

    def serve(self, session: str, position: int, prefix: int, tokens: list[int], k: int) -> None:
        self.loop.run_until_complete(self.host.serve(self._work(
            self._request(session, position, prefix, tokens, k, self.greedy, False))))

    def rpc(self, tokens: list[int], session: str = "bench") -> tuple[float, float]:
        """A Score through gRPC: (wall seconds, the server's forward seconds)."""
        from specdec.v1 import model_pb2

        t0 = time.perf_counter()
        reply = self.target.Score(model_pb2.ScoreRequest(
            session_id=session, cache_position=self.n, prefix_hash=self.h, tokens=tokens,
            k=len(tokens) - 1), timeout=60)
        return time.perf_counter() - t0, reply.timing.forward_ms / 1e3

    def local(self, tokens: list[int], session: str = "bench") -> float:
        t0 = time.perf_counter()
        self.serve(session, self.n, self.h, tokens, len(tokens) - 1)
        return time.perf_counter() - t0

    def forward(self, model) -> float:
        """A raw 1-token forward after the prompt (cache prefilled once, cropped back)."""
        import torch
        from transformers import DynamicCache

        with torch.inference_mode():
            if id(model) not in self.caches:
                self.caches[id(model)] = DynamicCache(config=model.config)
                model(input_ids=torch.tensor([self.prompt]), cache=self.caches[id(model)], use_cache=True,
                      logits_to_keep=1)
            cache = self.caches[id(model)]
            t0 = time.perf_counter()
            model(input_ids=torch.tensor([ONE]), position_ids=torch.tensor([[self.n]]),
                  cache=cache, use_cache=True, logits_to_keep=1)
            elapsed = time.perf_counter() - t0
            cache.crop(-1)
        return elapsed

    def propose4(self) -> float:
        from specdec.v1 import model_pb2

        t0 = time.perf_counter()
        self.draft.Propose(model_pb2.ProposeRequest(
            session_id="bench", cache_position=self.n, prefix_hash=self.h, tokens=ONE, k=4), timeout=60)
        return time.perf_counter() - t0

    def prefill(self) -> None:
        """The prompt prefilled everywhere (target service, in-process host, draft), then a warm-up."""
        from specdec.v1 import model_pb2

        self.target.Score(model_pb2.ScoreRequest(session_id="bench", tokens=self.prompt), timeout=60)
        self.serve("bench", 0, 0, self.prompt, 0)
        self.draft.Propose(model_pb2.ProposeRequest(session_id="bench", tokens=self.prompt, k=0), timeout=60)
        for _ in range(3):
            self.rpc(FIVE), self.rpc(ONE), self.local(ONE)

    def series(self, reps: int, full, early) -> dict[str, list[float]]:
        """Every probe `reps` times, interleaved: drift and neighbours hit every series alike."""
        s = {k: [] for k in ("rpc5", "rpc1", "srv5", "srv1", "local1", "fwd_full", "fwd_early", "propose4")}
        for _ in range(reps):
            wall, server = self.rpc(FIVE)
            s["rpc5"].append(wall), s["srv5"].append(server)
            wall, server = self.rpc(ONE)
            s["rpc1"].append(wall), s["srv1"].append(server)
            s["local1"].append(self.local(ONE))
            s["fwd_full"].append(self.forward(full))
            s["fwd_early"].append(self.forward(early))
            s["propose4"].append(self.propose4())
        return s


def _figures(s: dict[str, list[float]], n: int, args: argparse.Namespace) -> dict:
    """The medians and ratios the report prints (and --json writes)."""
    med = {k: _median_ms(v) for k, v in s.items()}
    return {
        "prompt_tokens": n,
        "threads": args.threads,
        "reps": args.reps,
        "score5_ms": med["rpc5"],
        "score1_ms": med["rpc1"],
        "score5_over_score1": med["rpc5"] / med["rpc1"],
        "server_forward5_over_forward1": med["srv5"] / med["srv1"],
        "inprocess_score1_ms": med["local1"],
        "grpc_overhead_ms": med["rpc1"] - med["local1"],
        "grpc_overhead_paired_ms": statistics.median(
            a - b for a, b in zip(s["rpc1"], s["local1"])) * 1e3,
        "rpc1_minus_server_forward_ms": statistics.median(
            a - b for a, b in zip(s["rpc1"], s["srv1"])) * 1e3,
        "forward1_full_ms": med["fwd_full"],
        "forward1_early_exit2_ms": med["fwd_early"],
        "draft_cost_ratio_c": med["fwd_early"] / med["fwd_full"],
        "propose4_ms": med["propose4"],
    }


def _print(figures: dict, args: argparse.Namespace) -> None:
    print(f"service bench: SmolLM2-135M-Instruct fp32 on CPU, {args.threads} thread(s), prompt "
          f"{figures['prompt_tokens']} tokens, median of {args.reps} interleaved reps")
    print(f"  a) Score 5 new tokens {figures['score5_ms']:.1f} ms vs 1 token {figures['score1_ms']:.1f} ms"
          f" -> ratio {figures['score5_over_score1']:.2f}x (goal <= 1.5x; server forward ratio"
          f" {figures['server_forward5_over_forward1']:.2f}x)")
    print(f"  b) 1-token Score via gRPC {figures['score1_ms']:.2f} ms vs in-process"
          f" {figures['inprocess_score1_ms']:.2f} ms -> {figures['grpc_overhead_ms']:+.2f} ms"
          f" (median of paired differences {figures['grpc_overhead_paired_ms']:+.2f} ms; goal <= 2 ms;"
          f" RPC wall minus server forward: {figures['rpc1_minus_server_forward_ms']:.2f} ms)")
    print(f"  c) 1-token forward: early-exit draft (2/30 layers) {figures['forward1_early_exit2_ms']:.1f} ms"
          f" vs full target {figures['forward1_full_ms']:.1f} ms -> c = {figures['draft_cost_ratio_c']:.2f};"
          f" Propose(k=4) via gRPC {figures['propose4_ms']:.1f} ms")
    print(f"  d) transport: GetInfo round trip {figures['getinfo_rtt_ms']:.2f} ms; tiny-model 1-token Score"
          f" {figures['tiny_score_rtt_ms']:.2f} ms of which server {figures['tiny_server_total_ms']:.2f} ms"
          f" (forward {figures['tiny_server_forward_ms']:.2f} ms)")


if __name__ == "__main__":
    sys.exit(main())

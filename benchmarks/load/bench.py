"""python -m benchmarks.load: many concurrent streams, with and without batching, and the in-process peer.

N = 1, 2, 4, 8, 16 concurrent greedy streams (suite prompts, one each, all
started at once) x {target-only, adaptive draft (k chosen per round by the
orchestrator for goodput), draft k = 4, prompt lookup k = 4}, on two stacks
started side by side:

  batched    the services as they start by default (cross-session batching)
  unbatched  the same with --max-batch 1 (one request per forward)

and the in-process peer on the same weights: transformers `generate` over a
left-padded batch of the same N prompts (greedy), and `assistant_model=` with
the same draft at batch 1 (k = 4; it serves one request at a time, so it runs
at N = 1). Cells are interleaved: for each repetition and each N, every
configuration runs once, the order rotated.

Per cell: aggregate tokens/s (all streams' tokens / first start to last end),
per-stream tokens/s, TTFT and inter-token latency p50/p99, the batches the
services formed (their Prometheus histograms specdec_batch_rows and
specdec_batch_tokens, deltas over the cell), and for the adaptive draft the
k its rounds used. Greedy identity: every stream's tokens must equal
target-only alone on the batched stack (run first, one prompt at a time);
otherwise the run exits 1 and lists the mismatches.

One torch thread per process; the target and the draft get one each (on a
2-core machine: one core each). Full mode on the embedded models (SmolLM2-135M
+ the shipped distilled draft, 32 new tokens) takes about 15-25 minutes on 2
cores. --quick --tiny (tiny random models, N = 1, 4, 12 tokens) is the CI
variant. Outputs in --out: results.json, results.md, tps_vs_n.png,
ttft_vs_n.png (benchmarks.load.report; re-render with
`python -m benchmarks.load.report DIR/results.json`), and logs/ with every
stack's service logs (the speculation gate logs its verdicts there).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from benchmarks import suite
from benchmarks.load import profile as load_profile
from benchmarks.load import report as load_report
from specdec.runtime import heap

REPO = Path(__file__).resolve().parents[2]
BATCHED, UNBATCHED, PEER = "batched", "unbatched", "peer"


@dataclass(frozen=True)
class LoadConfig:
    name: str
    proposer: str  # none / draft / lookup (services); padded / assisted (peer)
    k: int = 0  # draft: 0 = adaptive


SERVICE_CONFIGS = (
    LoadConfig("target-only", "none"),
    LoadConfig("default", "default", 0),  # what a request that names nothing gets (combined, default k)
    LoadConfig("adaptive", "draft", 0),
    LoadConfig("draft-k4", "draft", 4),
    LoadConfig("lookup-k4", "lookup", 4),
)
PEER_PADDED = LoadConfig("hf-padded", "padded")
PEER_ASSISTED = LoadConfig("hf-assisted-k4", "assisted", 4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI sizes: N = 1, 4; 12 new tokens")
    p.add_argument("--tiny", action="store_true", help="tiny random models (tests.tiny.build_pair)")
    p.add_argument("--tiny-vocab", type=int, default=0, help="with --tiny: pad both vocabularies to this many "
                   "ids (e.g. 49152 or 151936, real models' sizes: what the vocabulary costs per round)")
    p.add_argument("--target", help="target --model; default: the embedded one")
    p.add_argument("--draft", help="draft --model; default: the draft service's own (the distilled draft)")
    p.add_argument("--ns", help="concurrent streams (full 1,2,4,8,16; quick 1,4)")
    p.add_argument("--max-new-tokens", type=int, help="(full 32, quick 12)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every cell (default 1)")
    p.add_argument("--configs", default=",".join(c.name for c in SERVICE_CONFIGS),
                   help="service configurations to run (default: all)")
    p.add_argument("--max-batch", type=int, default=None, help="the batched stack's --max-batch "
                   "(default: the services' own)")
    p.add_argument("--no-unbatched", action="store_true", help="skip the --max-batch 1 stack")
    p.add_argument("--no-peer", action="store_true", help="skip the in-process peer")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--orchestrator-workers", type=int, default=1,
                   help="orchestrator processes per configuration, over the same services; a cell's "
                        "streams are dealt out among them in turn (default 1)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the orchestrators' --stream-interval: tokens gathered into one chunk message "
                        "of a stream (default 1: every round)")
    p.add_argument("--orchestrator-flags", action="append", default=[], metavar="FLAGS",
                   help="more flags for every orchestrator of the run, as one string (repeatable), "
                        "e.g. --orchestrator-flags='--batch-max-items 32'")
    p.add_argument("--multiplex", action="store_true",
                   help="each cell's streams to one orchestrator share one GenerateMany stream, their "
                        "chunks packed into one message per moment (client.multiplex), as the gateway "
                        "sends them; default: a Generate stream each")
    p.add_argument("--suite", type=Path, default=suite.DEFAULT_SUITE)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "load")
    p.add_argument("--redis-url", default=os.environ.get("SPECDEC_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--no-limit", action="store_true",
                   help="skip measuring the physical limit (one in-process forward over N rows)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every stream generates exactly --max-new-tokens (GenerateRequest.ignore_eos): "
                        "batches are not thinned by answers that end early")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="before the cells, run each configuration at each N for this many seconds, "
                        "not recorded: the speculation gate's verdicts settle (steady state; default 0: "
                        "the cells meet a cold gate)")
    p.add_argument("--profile", action="store_true",
                   help="sample each cell's orchestrator and the target service with py-spy: "
                        "OUT/profiles/*.txt, and the parts of the orchestrator's CPU in results.md "
                        "(benchmarks.load.profile); py-spy takes CPU too, so a profiled run's speeds "
                        "are not compared with an unprofiled one's")
    p.add_argument("--profile-stopping", action="store_true",
                   help="with --profile: py-spy stops the process for each sample (whole stacks; "
                        "without it, a sample read while the process runs may hold only part of its "
                        "stack, which then counts in the part its innermost frame names)")
    args = p.parse_args(argv)
    if args.profile and not load_profile.Sampler.available():
        p.error("--profile needs py-spy on PATH (pip install -e '.[bench]')")
    args.ns = [int(x) for x in (args.ns or ("1,4" if args.quick else "1,2,4,8,16")).split(",") if x.strip()]
    args.max_new_tokens = args.max_new_tokens or (12 if args.quick else 32)
    names = {c.name: c for c in SERVICE_CONFIGS}
    try:
        args.configs = [names[n.strip()] for n in args.configs.split(",") if n.strip()]
    except KeyError as exc:
        p.error(f"--configs: unknown {exc}; expected some of {', '.join(names)}")
    if (min(args.ns) < 1 or args.reps < 1 or args.max_new_tokens < 1 or args.orchestrator_workers < 1
            or args.stream_interval < 1 or args.warmup_s < 0):
        p.error("--ns, --reps, --max-new-tokens, --orchestrator-workers and --stream-interval must be >= 1, "
                "--warmup-s >= 0")
    return args


# ---------------------------------------------------------------------------- the stacks


def batching_flag_available() -> bool:
    """Whether the model services take --max-batch (cross-session batching)."""
    try:
        out = subprocess.run([sys.executable, "-m", "target_service", "--help"], cwd=REPO, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--max-batch" in out


class LoadStack:
    """Target + draft (each with a metrics endpoint) + two orchestrators on them: one with
    --default-k auto (the adaptive config) and one with every default (the default config)."""

    def __init__(self, name: str, args, log_dir: Path, service_flags: list[str]) -> None:
        from specdec.runtime.launch import Processes, child_env

        self.name, self.args, self.flags = name, args, service_flags
        self.prefix = f"specdec-load-{uuid.uuid4().hex[:8]}:"
        env = child_env(args.threads, quiet=True, SPECDEC_THREADS=str(args.threads), SPECDEC_REDIS_URL="")
        self.group = Processes(log_dir / name, env=env)
        (log_dir / name).mkdir(parents=True, exist_ok=True)
        self.address = ""
        self.default_address = ""
        self.metrics: dict[str, str] = {}
        self._pending: list[tuple[str, object]] = []

    def start(self) -> None:
        """Start the services (not waiting); `wait` makes them healthy and starts the orchestrator."""
        from specdec.runtime import procs
        from specdec.runtime.launch import service_argv

        self.services = {}
        for role, model in (("target", self.args.target), ("draft", self.args.draft)):
            port, mport = procs.free_port(), procs.free_port()
            argv = service_argv(role, port, model=model, threads=self.args.threads, metrics_port=mport,
                                extra=self.flags)
            proc = self.group.start(role, argv)
            self.services[role] = f"127.0.0.1:{port}"
            self.metrics[role] = f"http://127.0.0.1:{mport}/metrics"
            self._pending.append((self.services[role], proc))

    def wait(self) -> None:
        from specdec.runtime import procs
        from benchmarks.stack import SUFFIX_CACHE_OFF, suffix_cache_flags

        for address, proc in self._pending:
            procs.wait_healthy(address, proc, timeout=600)
        # Every stream of a cell is admitted: this benchmark measures throughput, not
        # shedding (benchmarks.faults.gray_bench measures admission); the unbatched stack's target
        # would otherwise hold one session (its batch size).
        admit = ["--target-capacity", str(max(self.args.ns))]
        # Nor does it measure the per-tenant call rate: a fast machine's cells open more than
        # its default 50 calls a second, all from the one tenant.
        admit += ["--rate-per-tenant", "0"]
        # The cells replay the same prompts: suffix decoding learns nothing across requests here.
        admit += suffix_cache_flags(SUFFIX_CACHE_OFF)
        admit += ["--stream-interval", str(self.args.stream_interval)]
        admit += [flag for given in self.args.orchestrator_flags for flag in shlex.split(given)]
        self.address = self._orchestrators("orchestrator", admit, default_k="auto")
        self.default_address = self._orchestrators("orchestrator-default", admit)

    def _orchestrators(self, name: str, extra: list[str], **flags) -> str:
        """--orchestrator-workers orchestrator processes over the stack's services, each on its own
        port (named name, name.2, ...); their addresses, joined by commas."""
        from specdec.runtime import procs
        from specdec.runtime.launch import orchestrator_argv

        addresses = []
        for i in range(self.args.orchestrator_workers):
            port = procs.free_port()
            argv = orchestrator_argv(port, tokenizer=self.args.target, targets=[self.services["target"]],
                                     drafts=[self.services["draft"]], redis_url=self.args.redis_url,
                                     redis_prefix=self.prefix, threads=1, extra=extra, **flags)
            addresses.append(self.group.serve(name if i == 0 else f"{name}.{i + 1}", argv, port, timeout=300))
        return ",".join(addresses)

    def orchestrator_pids(self, config: LoadConfig) -> dict[str, int]:
        """{process name: pid} of the orchestrator process(es) serving `config`."""
        base = "orchestrator-default" if config.proposer == "default" else "orchestrator"
        return {name: proc.pid for name, proc in self.group.running.items()
                if name == base or name.startswith(base + ".")}

    def address_for(self, config: LoadConfig) -> str:
        return self.default_address if config.proposer == "default" else self.address

    def cpu(self) -> dict[str, float]:
        """{process: CPU seconds (user + system) so far} for the stack's processes, and "client" for
        this one (it runs every cell's streams)."""
        out = {name: proc_cpu_s(proc.pid) for name, proc in self.group.running.items()}
        out["client"] = time.process_time()
        return {name: v for name, v in out.items() if v is not None}

    def redis_commands(self) -> int | None:
        """Commands the Redis server has run so far, all clients together (INFO commandstats): a
        cell's difference is what its streams cost Redis while nothing else uses that server."""
        try:
            import redis

            stats = redis.Redis.from_url(self.args.redis_url, socket_timeout=2).info("commandstats")
        except Exception:  # noqa: BLE001 - the figure is left out, the cell still runs
            return None
        return sum(int(v.get("calls", 0)) for v in stats.values())

    def scrape(self) -> dict:
        """{role: {metric: {"count", "sum", "buckets": {le: cumulative}}}} for the batch histograms."""
        return parse_scrape(self.fetch())

    def fetch(self) -> dict[str, str]:
        """{role: the metrics page's text}: only the fetch (it waits on the socket, so it does not hold
        up this process's streams the way parsing would; parse_scrape later)."""
        return {role: _fetch(url) for role, url in self.metrics.items()}

    def stop(self) -> None:
        self.group.stop_all()
        try:
            import redis

            client = redis.Redis.from_url(self.args.redis_url, socket_timeout=2)
            keys = list(client.scan_iter(match=f"{self.prefix}*", count=500))
            if keys:
                client.delete(*keys)
        except Exception:  # noqa: BLE001 - best effort; the keys carry a TTL anyway
            pass


HISTOGRAMS = ("specdec_batch_rows", "specdec_batch_tokens")
TARGET_PROFILE = "target"  # --profile: the target service's samples go to OUT/profiles/*-target.txt
ROUND_FIELDS = ("total_ms", "draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms",
                "redis_ms")  # Stats.rounds[] fields kept per round (load_report.ROUND_PARTS)
MODEL_CALLS = ("Score", "ScoreBatch", "Propose", "ProposeBatch")  # RPCs counted per token


def _fetch(url: str) -> str:
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return ""


def parse_scrape(pages: dict[str, str]) -> dict:
    return {role: _histograms(text) for role, text in pages.items()}


def _histograms(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    if not text:
        return {}
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "specdec_pass_seconds":  # forward passes' wall time (each pass once)
            out["pass_seconds"] = {"count": 0.0, "sum": sum(s.value for s in family.samples
                                                            if s.name.endswith("_total")), "buckets": {}}
            continue
        if family.name == "specdec_requests":  # the counter (exposed as specdec_requests_total)
            h = out.setdefault("specdec_rpcs", {"count": 0.0, "sum": 0.0, "buckets": {}})
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("method", "").rsplit("/", 1)[-1] in MODEL_CALLS:
                    h["count"] += s.value
            continue
        if family.name not in HISTOGRAMS:
            continue
        h = out.setdefault(family.name, {"count": 0.0, "sum": 0.0, "buckets": {}})
        for s in family.samples:  # summed over label sets (Score/Propose kinds, if labelled)
            if s.name.endswith("_bucket"):
                le = s.labels.get("le", "+Inf")
                h["buckets"][le] = h["buckets"].get(le, 0.0) + s.value
            elif s.name.endswith("_count"):
                h["count"] += s.value
            elif s.name.endswith("_sum"):
                h["sum"] += s.value
    return out


def histogram_delta(before: dict, after: dict) -> dict:
    """Per role and metric: forwards, mean, and the bucket counts formed between two scrapes."""
    out: dict[str, dict] = {}
    for role, metrics in after.items():
        for name, h in metrics.items():
            b = before.get(role, {}).get(name, {"count": 0.0, "sum": 0.0, "buckets": {}})
            count = h["count"] - b["count"]
            cum = {le: v - b["buckets"].get(le, 0.0) for le, v in h["buckets"].items()}
            ordered = sorted(cum.items(), key=lambda kv: math.inf if kv[0] == "+Inf" else float(kv[0]))
            per_bucket, prev = {}, 0.0
            for le, v in ordered:
                if v - prev > 0:
                    per_bucket[le] = v - prev
                prev = v
            out.setdefault(role, {})[name.replace("specdec_", "")] = {
                "forwards": count, "mean": (h["sum"] - b["sum"]) / count if count else None,
                "sum": h["sum"] - b["sum"], "buckets": per_bucket}
    return out


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used, from /proc (None where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_stream_round(before: dict[str, float], after: dict[str, float], batches: dict, rounds: int,
                         orchestrator: str) -> dict[str, float] | None:
    """Each process's CPU time per stream-round over a cell, µs: the orchestrator that served it, the
    client (this process), and each model service's outside its forward passes (its CPU time minus the
    passes' wall time; with one torch thread a pass's CPU is its wall time)."""
    if not rounds or not before or not after:
        return None
    used = {name: after[name] - before[name] for name in after if name in before}
    out = {}
    if orchestrator in used:  # with --orchestrator-workers, its processes together
        spent = sum(v for name, v in used.items() if name == orchestrator or name.startswith(orchestrator + "."))
        out["orchestrator"] = spent / rounds * 1e6
    if "client" in used:
        out["client"] = used["client"] / rounds * 1e6
    for role in ("target", "draft"):
        if role in used:
            passes = (batches.get(role, {}).get("pass_seconds") or {}).get("sum") or 0.0
            out[role] = max(0.0, used[role] - passes) / rounds * 1e6
            out[f"{role}_forward"] = passes / rounds * 1e6
    return out


# ---------------------------------------------------------------------------- streams


class DecodeMark:
    """When every stream of a cell has its first token (all prompts prefilled: the decode phase
    begins), `scrape` runs once (in a thread) and its result and time are kept."""

    def __init__(self, streams: int, scrape=None) -> None:
        self.waiting = streams
        self.scrape = scrape
        self.task: asyncio.Task | None = None
        self.at_s: float | None = None

    def first_token(self, now_s: float) -> None:
        self.waiting -= 1
        if self.waiting == 0 and self.scrape is not None:
            self.at_s = now_s
            self.task = asyncio.get_running_loop().create_task(asyncio.to_thread(self.scrape))

    async def result(self) -> dict | None:
        return await self.task if self.task is not None else None


async def _stream(stub, request, start: float, mark: DecodeMark | None = None, mux=None) -> dict:
    from specdec.v1 import orchestrator_pb2 as pb

    token_ids, chunks, stats = [], [], None
    call = mux.generate(request, timeout=900) if mux is not None else stub.Generate(request, timeout=900)
    async for event in call:
        if event.HasField("chunk"):
            if event.chunk.token_ids:
                chunks.append((time.perf_counter() - start, len(event.chunk.token_ids)))
                token_ids.extend(event.chunk.token_ids)
                if mark is not None and len(chunks) == 1:
                    mark.first_token(chunks[0][0])
        else:
            stats = event.stats
    end = time.perf_counter() - start
    if stats is None:
        raise RuntimeError("stream ended without Stats")
    if stats.session_id:
        await stub.EndSession(pb.EndSessionRequest(session_id=stats.session_id), timeout=30)
    return {"token_ids": token_ids, "chunks": chunks, "end_s": end,
            "ttft_s": chunks[0][0] if chunks else end, "prompt_tokens": stats.prompt_tokens,
            "rounds_k": [r.k for r in stats.rounds], "proposer_used": stats.proposer,
            "rounds": len(stats.rounds),
            # Where each round's time went (Stats.rounds; load_report.ROUND_PARTS), rounds after the first.
            "round_ms": [[round(getattr(r, f), 2) for f in ROUND_FIELDS] for r in stats.rounds[1:]]}


async def run_streams(address: str, config: LoadConfig, prompts: list[suite.Prompt], max_new: int,
                      seed: int, *, ignore_eos: bool = False, scrape=None,
                      multiplex: bool = False) -> tuple[list[dict], dict | None]:
    """All prompts' streams at once through the orchestrator at `address`; with `scrape`, also
    its result once every stream has its first token (DecodeMark), with the time as "at_s".
    `multiplex`: the streams to one address share one GenerateMany stream (client.multiplex)."""
    import grpc

    from client.multiplex import Multiplexed

    from specdec.v1 import common_pb2, orchestrator_pb2 as pb, orchestrator_pb2_grpc

    kind = "" if config.proposer == "default" else config.proposer  # a registered kind's name
    channels = [grpc.aio.insecure_channel(a) for a in address.split(",")]  # streams dealt out in turn
    try:
        stubs = [orchestrator_pb2_grpc.OrchestratorStub(c) for c in channels]
        muxes = [Multiplexed(c) if multiplex else None for c in channels]
        requests = [pb.GenerateRequest(
            messages=[pb.ChatMessage(role=r, content=c) for r, c in p.messages], max_new_tokens=max_new,
            sampling=common_pb2.SamplingParams(temperature=0.0), seed=seed, proposer_name=kind, k=config.k,
            strict=config.proposer != "default", ignore_eos=ignore_eos) for p in prompts]
        mark = DecodeMark(len(requests), scrape)
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(stubs[i % len(stubs)], r, start, mark, muxes[i % len(muxes)])
                                         for i, r in enumerate(requests)))
        decoding = await mark.result()
    finally:
        for channel in channels:
            await channel.close()
    for p, r in zip(prompts, results):
        r["prompt_id"] = p.id
    return list(results), (None if decoding is None else {"at_s": mark.at_s, "scrape": decoding})


# ---------------------------------------------------------------------------- the in-process peer


class Peer:
    """The same weights in this process: padded-batch greedy `generate`, and assisted at batch 1."""

    def __init__(self, args) -> None:
        from draft_service.role import default_draft
        from engine.model.loader import load

        self.target = load(args.target, device="cpu", dtype="float32")
        self.draft = load(args.draft or default_draft(), device="cpu")
        self.eos = list(self.target.eos_token_ids)
        self.ignore_eos = args.ignore_eos  # generate exactly max_new tokens, as the services' streams
        tok = self.target.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        self._ids: dict[str, list[int]] = {}

    def ids(self, prompt: suite.Prompt) -> list[int]:
        from orchestrator.common.text import encode_prompt

        if prompt.id not in self._ids:
            self._ids[prompt.id] = encode_prompt(self.target.tokenizer, "", prompt.messages)
        return self._ids[prompt.id]

    def _cut(self, new: list[int]) -> list[int]:
        if self.ignore_eos:
            return new
        for i, tok in enumerate(new):
            if tok in self.eos:
                return new[: i + 1]
        return new

    def padded(self, prompts: list[suite.Prompt], max_new: int) -> list[dict]:
        """One `generate` over the left-padded batch; a token per row each forward."""
        import torch

        rows = [self.ids(p) for p in prompts]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        ends: list[float] = []
        handle = self.target.model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                out = self.target.model.generate(
                    input_ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new if self.ignore_eos else 0, do_sample=False,
                    temperature=None, top_p=None, top_k=None, eos_token_id=self.eos, pad_token_id=self.pad,
                    use_cache=True)
                end = time.perf_counter() - start
        finally:
            handle.remove()
        steps = [t - start for t in ends]  # forward i ends: every unfinished row has its token i + 1
        results = []
        for i, p in enumerate(prompts):
            new = self._cut(out[i, width:].tolist())
            chunks = [(steps[j] if j < len(steps) else end, 1) for j in range(len(new))]
            results.append({"prompt_id": p.id, "token_ids": new, "chunks": chunks,
                            "end_s": chunks[-1][0] if chunks else end, "ttft_s": chunks[0][0] if chunks else end,
                            "prompt_tokens": len(rows[i]), "rounds_k": [], "proposer_used": "hf-padded"})
        return results

    def assisted(self, prompt: suite.Prompt, max_new: int) -> list[dict]:
        import torch

        from benchmarks.inprocess import PeerConfig, generate

        ids = torch.tensor([self.ids(prompt)])
        r = generate(self.target.model, self.draft.model, ids, PeerConfig("assisted", 4),
                     max_new_tokens=max_new, eos_token_ids=None if self.ignore_eos else self.eos)
        n = max(1, len(r.token_ids))
        # transformers streams a round's tokens together; spread the rest evenly after the first.
        step = (r.wall_s - r.ttft_s) / max(1, n - 1)
        chunks = [(r.ttft_s + i * step, 1) for i in range(len(r.token_ids))]
        return [{"prompt_id": prompt.id, "token_ids": r.token_ids, "chunks": chunks, "end_s": r.wall_s,
                 "ttft_s": r.ttft_s, "prompt_tokens": r.prompt_tokens, "rounds_k": [],
                 "proposer_used": "hf-assisted"}]


# ---------------------------------------------------------------------------- main


def limit_sizes(ns: list[int]) -> list[int]:
    """Row counts the physical limit is measured at: every N, and enough in between that the
    decode phase's shrinking batches (streams ending) are interpolated, not guessed."""
    top = max(ns)
    grid = set(ns) | {n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n <= top}
    if top <= 16:
        grid |= set(range(1, top + 1))
    return sorted(grid)


class PhysicalLimit:
    """The cost of one in-process forward over n one-token rows (the engine, the same weights, one
    thread), and the tokens/s it allows: n / that cost. Its sessions first hold their prompts, as
    the streams' do. Kept for the whole run: `curve` measures every row count of limit_sizes once,
    and `measure` one row count again right before a cell (the machine's speed drifts; a cell is
    held to the limit measured next to it)."""

    def __init__(self, args, prompts: list[suite.Prompt], top: int, grow: int = 0) -> None:
        import torch

        from engine.host import HostLimits, pick_runner
        from engine.model.loader import load
        from engine.plan import RowPlan, StepPlan

        self._torch, self._row, self._plan = torch, RowPlan, StepPlan
        lm = load(args.target, device="cpu", dtype="float32")
        self.runner = pick_runner(lm, HostLimits(max_batch=top))
        # Two sets of sessions: holding their prompts (the limit as defined: what a cell's first
        # decoding step costs), and holding their prompts plus `grow` tokens more (the decode
        # phase's mean context: half the tokens a stream generates). Attention grows with the
        # context: 16 rows cost 48.3 ms at the suite prompts' lengths, 51.5 ms 32 tokens later,
        # 54.4 ms 64 tokens later, so a decode phase held to the first figure is held to a forward
        # it never runs.
        self.caches = self._sessions(lm.tokenizer, prompts[:top], 0)
        self.grown = self._sessions(lm.tokenizer, prompts[:top], grow) if grow else self.caches

    def _sessions(self, tokenizer, prompts: list[suite.Prompt], grow: int) -> list:
        """A session per prompt holding it, plus `grow` filler tokens."""
        from orchestrator.common.text import encode_prompt

        out = []
        with self._torch.inference_mode():
            for p in prompts:
                tokens = list(encode_prompt(tokenizer, "", p.messages)) + [7] * grow
                cache = self.runner.new_cache()
                for start in range(0, len(tokens), 64):
                    chunk = tokens[start:start + 64]
                    cache.reserve(cache.length + len(chunk))
                    self.runner.logits(self._plan([self._row(cache, chunk, cache.length, 0)]))
                out.append(cache)
        return out

    def measure(self, n: int, reps: int = 9, grown: bool = False) -> float:
        """The median ms of `reps` forwards over n rows (after one warm-up); `grown`: the sessions
        holding their prompts and the decode phase's mean generated length."""
        times, sessions = [], (self.grown if grown else self.caches)[:n]
        with self._torch.inference_mode():
            for _ in range(reps + 1):
                rows = []
                for cache in sessions:
                    cache.reserve(cache.length + 1)
                    rows.append(self._row(cache, [7], cache.length, 1))
                t0 = time.perf_counter()
                self.runner.run(self._plan(rows))
                times.append(time.perf_counter() - t0)
                for cache in sessions:
                    cache.crop(cache.length - 1)
        return sorted(times[1:])[len(times[1:]) // 2] * 1e3

    def curve(self, ns: list[int]) -> dict[int, dict]:
        out = {}
        for n in limit_sizes(ns):
            forward = self.measure(n)
            out[n] = {"forward_ms": forward, "limit_tps": n / forward * 1e3}
        return out


def plan(args, modes: list[str]) -> list[tuple[int, int, str, LoadConfig]]:
    """(rep, N, mode, config) cells: per repetition and N, every configuration once, rotated."""
    cells = [(mode, c) for mode in modes for c in args.configs]
    if not args.no_peer:
        cells.append((PEER, PEER_PADDED))
    out, turn = [], 0
    for rep in range(args.reps):
        for n in args.ns:
            shift = turn % len(cells)
            order = cells[shift:] + cells[:shift]
            if not args.no_peer and n == min(args.ns):
                order.append((PEER, PEER_ASSISTED))  # batch 1 by definition: measured once per rep
            out += [(rep, n, mode, c) for mode, c in order]
            turn += 1
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.stack import prepare_run

    workdir = prepare_run(args, "specdec-load-")
    started = time.time()
    batching = batching_flag_available()
    modes = [BATCHED] + ([UNBATCHED] if batching and not args.no_unbatched else [])
    prompts = suite.subset(suite.load(args.suite), -(-max(args.ns) // 5))[: max(args.ns)]
    # More streams than prompts: prompts repeat (each stream is still its own session).
    prompts = [prompts[i % len(prompts)] for i in range(max(args.ns))]
    cells = plan(args, modes)
    print(f"benchmarks.load: N = {args.ns}, {len(cells)} cells, batching flag "
          f"{'available' if batching else 'NOT available (services run one request per forward)'}; "
          f"out {args.out}", file=sys.stderr)

    stacks: dict[str, LoadStack] = {}
    records: list[dict] = []
    limit: dict[int, dict] = {}
    reference: dict[str, list[int]] = {}
    failure, result = None, None
    try:
        peer = _start_stacks(args, modes, batching, workdir, stacks)
        limiter = None
        if not args.no_limit:
            limiter = PhysicalLimit(args, prompts, max(args.ns), grow=args.max_new_tokens // 2)
            limit = limiter.curve(args.ns)
            print("physical limit (one in-process forward over N rows): " + ", ".join(
                f"N={n} {v['limit_tps']:.0f} tok/s" for n, v in limit.items()), file=sys.stderr)
        _reference(args, modes, stacks, peer, prompts, reference)
        print(f"reference done ({time.time() - started:.0f} s); measuring", file=sys.stderr)
        # This process streams every cell's sessions too: its start-up heap (torch, the peer's
        # model) frozen, as the services freeze theirs, so its full collections (150-300 ms)
        # do not land inside a cell.
        heap.settle()
        raw = (args.out / "records.jsonl").open("w")
        for i, (rep, n, mode, config) in enumerate(cells):
            group = prompts[:n] if config is not PEER_ASSISTED else prompts[:1]
            record = _cell(args, rep, mode, config, group, stacks.get(mode), peer, limiter)
            records.append(record)
            raw.write(json.dumps(record) + "\n")
            raw.flush()
            tokens = sum(len(s["token_ids"]) for s in record["streams"])
            print(f"[{i + 1}/{len(cells)}] rep {rep} N={record['n']:2d} {mode:9s} {config.name:15s} "
                  f"{tokens / max(record['wall_s'], 1e-9):6.1f} tok/s", file=sys.stderr)
        raw.close()
    except BaseException as exc:  # noqa: BLE001 - still write what was measured
        failure = f"{type(exc).__name__}: {exc}"
        _print_log_tails(stacks, workdir)
        raise
    finally:
        for stack in stacks.values():
            stack.stop()
        if (workdir / "logs").is_dir():  # the services' logs (the gate's verdicts, ...) go with the results
            shutil.copytree(workdir / "logs", args.out / "logs", dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
        if records or failure:
            settings = _settings(args, batching, modes, prompts, limit, started, failure)
            result = _write(args, records, reference, settings)
    return _verdict(args, result, started)


def _print_log_tails(stacks: dict[str, LoadStack], workdir: Path) -> None:
    for stack in stacks.values():
        for log in sorted((workdir / "logs" / stack.name).glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {stack.name}/{log.name} (tail)\n" + "\n".join(tail), file=sys.stderr)


def _write(args, records: list[dict], reference: dict[str, list[int]], settings: dict) -> dict:
    """results.json, results.md and the plots in --out; returns the result."""
    result = load_report.build(records, reference, settings, _environment(args))
    # Compact: the records hold every chunk of every stream.
    (args.out / "results.json").write_text(json.dumps(load_report.json_safe(result)))
    load_report.render(result, args.out)
    return result


def _start_stacks(args, modes: list[str], batching: bool, workdir: Path,
                  stacks: dict[str, LoadStack]) -> Peer | None:
    """Start a stack per mode into `stacks` (the batched one, and --max-batch 1) and load the
    in-process peer while their services start; returns the peer (None with --no-peer)."""
    flags = {BATCHED: ["--max-batch", str(args.max_batch)] if batching and args.max_batch else [],
             UNBATCHED: ["--max-batch", "1"]}
    for mode in modes:
        stacks[mode] = LoadStack(mode, args, workdir / "logs", flags[mode])
        stacks[mode].start()
    peer = None if args.no_peer else Peer(args)  # loads while the services start
    for stack in stacks.values():
        stack.wait()
    return peer


def _reference(args, modes: list[str], stacks: dict[str, LoadStack], peer: Peer | None,
               prompts: list[suite.Prompt], reference: dict[str, list[int]]) -> None:
    """Target-only alone on the batched stack, one prompt at a time, into `reference`; then every
    configuration once, short and not recorded (the warm-up)."""
    for p in prompts:
        (r,), _ = asyncio.run(run_streams(stacks[BATCHED].address, SERVICE_CONFIGS[0], [p],
                                          args.max_new_tokens, args.seed, ignore_eos=args.ignore_eos))
        reference[p.id] = r["token_ids"]
    for mode in modes:
        for c in args.configs:
            asyncio.run(run_streams(stacks[mode].address, c, prompts[:2], 4, args.seed))
            if args.warmup_s > 0:
                _steady(args, stacks[mode], c, prompts)
    if peer is not None:
        peer.padded(prompts[:2], 4)
        peer.assisted(prompts[0], 4)


def _steady(args, stack: LoadStack, config: LoadConfig, prompts: list[suite.Prompt]) -> None:
    """--warmup-s: every N's streams over and over for that long, not recorded, so the speculation
    gate has scored drafting and plain decoding at each load level before the cells (a server's
    steady state; the cells alone are too short for its 1 s epochs)."""
    for n in args.ns:
        until = time.perf_counter() + args.warmup_s
        while time.perf_counter() < until:
            asyncio.run(run_streams(stack.address_for(config), config, prompts[:n], args.max_new_tokens,
                                    args.seed, ignore_eos=args.ignore_eos, multiplex=args.multiplex))


def _cell(args, rep: int, mode: str, config: LoadConfig, group: list[suite.Prompt], stack: LoadStack | None,
          peer: Peer | None, limiter: PhysicalLimit | None) -> dict:
    """One cell's streams over `group`, timed, with the batches the services formed (over the cell
    and over its decode phase); `stack` is None for the in-process peer."""
    # The physical limit at this N, measured again next to the cell (target-only's cells:
    # the ones held to it), with the services idle.
    held = limiter is not None and mode == BATCHED and config.proposer == "none"
    cell_limit = limiter.measure(len(group), reps=5) if held else None
    decode_limit = limiter.measure(len(group), reps=5, grown=True) if held else None
    sampler = _sampler(args, rep, config, len(group), stack)
    before = stack.scrape() if stack is not None else {}
    cpu_before = stack.cpu() if stack is not None else {}
    redis_before = stack.redis_commands() if stack is not None else None
    t0 = time.perf_counter()
    decoding = None
    if mode == PEER:
        streams = peer.padded(group, args.max_new_tokens) if config is PEER_PADDED \
            else peer.assisted(group[0], args.max_new_tokens)
    else:
        streams, decoding = asyncio.run(run_streams(
            stack.address_for(config), config, group, args.max_new_tokens, args.seed,
            ignore_eos=args.ignore_eos, scrape=stack.fetch, multiplex=args.multiplex))
    wall = time.perf_counter() - t0
    profiled = sampler.stop() if sampler is not None else []
    cpu_after = stack.cpu() if stack is not None else {}
    redis_after = stack.redis_commands() if stack is not None else None
    after = stack.scrape() if stack is not None else {}
    batches = histogram_delta(before, after) if stack is not None else {}
    record = {"rep": rep, "n": len(group), "mode": mode, "config": config.name,
              "proposer": config.proposer, "k": config.k, "wall_s": wall, "streams": streams,
              "batches": batches}
    if stack is not None:
        orchestrator = "orchestrator-default" if config.proposer == "default" else "orchestrator"
        rounds = sum(s.get("rounds", 0) for s in streams)
        record["cpu_us"] = cpu_per_stream_round(cpu_before, cpu_after, batches, rounds, orchestrator)
        if record["cpu_us"] is not None and redis_before is not None and redis_after is not None:
            # (the INFO calls themselves: 2 of them, well under one per round)
            record["cpu_us"]["redis_commands"] = (redis_after - redis_before) / rounds
    orchestrators = [p for p in profiled if not p.stem.endswith(f"-{TARGET_PROFILE}")]
    if orchestrators:
        record["profile"] = load_profile.parts(load_profile.merged(orchestrators))
    if cell_limit is not None:
        record["limit_ms"] = cell_limit
        record["decode_limit_ms"] = decode_limit
    if decoding is not None:  # the decode phase: from every stream's first token to the end
        record["decode"] = {"start_s": decoding["at_s"],
                            "batches": histogram_delta(parse_scrape(decoding["scrape"]), after)}
    return record


def _sampler(args, rep: int, config: LoadConfig, n: int, stack: LoadStack | None):
    """--profile: py-spy started on the orchestrator(s) serving this cell and on the target service."""
    if not args.profile or stack is None:
        return None
    sampler = load_profile.Sampler(stopping=args.profile_stopping)
    pids = {**stack.orchestrator_pids(config), TARGET_PROFILE: stack.group.running["target"].pid}
    for name, pid in pids.items():
        sampler.start(pid, args.out / "profiles" / f"{stack.name}-{config.name}-N{n}-rep{rep}-{name}.txt")
    time.sleep(0.5)  # py-spy attaches before the cell's streams start
    return sampler


def _settings(args, batching: bool, modes: list[str], prompts: list[suite.Prompt], limit: dict[int, dict],
              started: float, failure: str | None) -> dict:
    """The run's settings as results.json records them."""
    return {
        "command": "python -m benchmarks.load " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "quick": args.quick, "tiny": args.tiny, "ns": args.ns, "max_new_tokens": args.max_new_tokens,
        "reps": args.reps, "threads": args.threads, "max_batch": args.max_batch,
        "ignore_eos": args.ignore_eos, "orchestrator_workers": args.orchestrator_workers,
        "stream_interval": args.stream_interval, "multiplex": args.multiplex,
        "orchestrator_flags": args.orchestrator_flags, "profile": args.profile, "warmup_s": args.warmup_s,
        "batching_flag": batching, "modes": modes, "configs": [c.name for c in args.configs],
        "peer": not args.no_peer, "suite": Path(args.suite).name, "prompts": [p.id for p in prompts],
        "elapsed_s": time.time() - started, "failure": failure,
        "physical_limit": {str(n): v for n, v in limit.items()},
    }


def _verdict(args, result: dict | None, started: float) -> int:
    """0, or 1 when nothing was measured or a stream differs from target-only alone (listed)."""
    if result is None:
        print("nothing was measured", file=sys.stderr)
        return 1
    bad = result["identity"]["mismatches"]
    print(f"wrote {args.out}/results.json, results.md, plots, logs/ ({time.time() - started:.0f} s)",
          file=sys.stderr)
    if bad:
        print(f"GREEDY IDENTITY FAILED: {len(bad)} streams differ from target-only alone:", file=sys.stderr)
        for m in bad:
            print(f"  {m['prompt_id']} {m['mode']} {m['config']} N={m['n']} rep={m['rep']} "
                  f"first difference at token {m['first_difference']}", file=sys.stderr)
        return 1
    return 0


def _environment(args) -> dict:
    import platform

    import torch
    import transformers

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "target_model": args.target or "embedded default (SmolLM2-135M)",
            "draft_model": args.draft or "the draft service's default (shipped distilled draft)"}


"""Gray failures and overload, measured: hung and slow replicas, and 4x the load the stack is sized for.

    python -m benchmarks.faults.gray_bench               # the embedded target + the shipped draft
    python -m benchmarks.faults.gray_bench --tiny --freeze-s 5 --overload-s 20   # tiny models, quick

One stack: targets A and B, drafts D and D2 (1 thread each), orchestrators on
A and D ("one target"), on A, B and D ("two targets") and on A, D and D2 ("two
drafts"), with metrics ports.
Each stream is greedy, 64 new tokens, and its text is compared with the
fault-free target-only text. Scenarios (issue 21's goals):

  draft-frozen   one stream, proposer draft and combined, with one draft replica
                 ("one target") and with two ("two drafts": A, D, D2): draft D
                 SIGSTOPped after the first chunk for --freeze-s; its time against
                 the same stream unfrozen just before (goal: <= +2 s) and against
                 target-only (what the stream costs with no draft at all)
  target-frozen  two streams at once on "two targets" (one per target), target A
                 SIGSTOPped after the first chunk; the time of the stream(s) that
                 were on A against the same pair unfrozen (goal: <= +3 s)
  target-slow    target B CPU-starved 5x (SIGSTOP/SIGCONT duty cycle, 20 ms of
                 every 100), new 8-token sessions every 0.3 s: seconds until B is
                 ejected (metric specdec_replica_ejected) and sessions that still
                 went to B after that (goal: ejected within 10 s, none after)
  overload       "one target": its measured capacity C (specdec_target_capacity_sessions
                 after a warm-up at C streams), the p99 gap between chunks of
                 single streams, then 4C clients streaming for --overload-s: the
                 admitted streams' p99 gap (goal: <= 2x the unloaded p99), the
                 refusals (RESOURCE_EXHAUSTED) and how fast they came, streams
                 that hung, and admitted streams whose tokens differ (lost or
                 duplicated)

Prints one table and writes --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.stack import prepare_run
from client import Client
from specdec.runtime import procs
from specdec.runtime.launch import Processes, child_env, orchestrator_argv, service_argv
from tests.integration.faults import Throttle, freeze

PROMPTS = [
    "Explain what a KV cache is.",
    "Write a short poem about the sea.",
    "List three uses of a hash map.",
    "Rewrite this more formally: the cat sat on the mat and the dog sat on the log.",
    "Summarize: speculative decoding drafts tokens cheaply and verifies them in one pass.",
    "What is the capital of France? Answer in one sentence.",
    "Give two tips for writing clear code.",
    "Describe a sunrise in three sentences.",
]
MAX_NEW = 64


def metric(port: int, name: str, **labels: str) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def stream(address: str | Client, prompt: str, on_first=None, **options) -> dict:
    """One 64-token greedy stream: tokens, seconds, the gaps between chunks, stats or error."""
    if isinstance(address, str):
        with Client(address, timeout=300, retries=0) as c:
            return stream(c, prompt, on_first, **options)
    out = {"prompt": prompt, "tokens": [], "gaps": [], "error": None, "stats": None}
    started = last = time.perf_counter()
    try:
        s = address.generate(messages=[{"role": "user", "content": prompt}], max_new_tokens=MAX_NEW,
                             **options)
        for chunk in s:
            now = time.perf_counter()
            if out["tokens"]:
                out["gaps"].append(now - last)
            elif on_first is not None:
                on_first()
            last = now
            out["tokens"].extend(chunk.token_ids)
        out["stats"] = s.stats
    except grpc.RpcError as exc:
        out["error"] = (exc.code().name, exc.details())
    out["seconds"] = time.perf_counter() - started
    return out


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else 0.0)


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        env = child_env(1, quiet=True, SPECDEC_THREADS="1", SPECDEC_REDIS_URL="")
        self.group = Processes(workdir / "logs", env=env)
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.addr: dict[str, str] = {}
        self.metrics: dict[str, int] = {}
        self.prefix = f"specdec-gray-bench-{int(time.time())}:"

    def start(self) -> None:
        a = self.args
        ports = {}
        for name, role in (("A", "target"), ("B", "target"), ("D", "draft"), ("D2", "draft")):
            ports[name] = procs.free_port()
            model = a.target if role == "target" else a.draft
            self.group.start(name, service_argv(role, ports[name], model=model, threads=1))
            self.addr[name] = f"127.0.0.1:{ports[name]}"
        for name in ("A", "B", "D", "D2"):
            procs.wait_healthy(self.addr[name], self.group.running[name], timeout=600)
        for name, targets, drafts in (("one", ["A"], ["D"]), ("two", ["A", "B"], ["D"]),
                                      ("twod", ["A"], ["D", "D2"])):
            port, self.metrics[name] = procs.free_port(), procs.free_port()
            argv = orchestrator_argv(port, tokenizer=a.target, targets=[self.addr[t] for t in targets],
                                     drafts=[self.addr[d] for d in drafts], redis_url=a.redis_url,
                                     redis_prefix=self.prefix, threads=1,
                                     metrics_port=self.metrics[name],
                                     # one tenant drives 4x the capacity: its own limits off; the
                                     # capacity is measured with the pace rule (off by default)
                                     extra=("--max-streams-per-tenant", "0", "--rate-per-tenant", "0",
                                            "--capacity-pace", "1.5"))
            self.addr[name] = self.group.serve(name, argv, port, timeout=300)

    def stop(self) -> None:
        self.group.stop_all()

    def pid(self, name: str) -> int:
        return self.group.running[name].pid

    def wait_readmitted(self, orch: str, role: str, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while metric(self.metrics[orch], "specdec_replica_ejected", role=role, address=self.addr[name]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not readmitted")
            time.sleep(0.2)

    # ------------------------------------------------------------------ scenarios

    def references(self) -> dict[str, list[int]]:
        return {p: stream(self.addr["one"], p, proposer="none")["tokens"] for p in PROMPTS}

    def draft_frozen(self, ref: dict) -> list[dict]:
        """Per proposer, with one draft replica and with two: the same stream unfrozen, with its
        draft frozen after the first chunk, and target-only (what a stream without a draft costs)."""
        rows = []
        for orch in ("one", "twod"):
            for proposer in ("draft", "combined"):
                for prompt in PROMPTS[:2]:
                    rows.append(self._draft_frozen_once(orch, proposer, prompt, ref))
        return rows

    def _draft_frozen_once(self, orch: str, proposer: str, prompt: str, ref: dict) -> dict:
        address = self.addr[orch]
        stream(address, prompt, proposer=proposer)  # warm
        for _ in range(4):  # with two drafts: until the stream was on the one frozen (D)
            base = stream(address, prompt, proposer=proposer)
            alone = stream(address, prompt, proposer="none")
            timers = []
            hit = stream(address, prompt, proposer=proposer,
                         on_first=lambda: timers.append(freeze(self.pid("D"), self.args.freeze_s)))
            for t in timers:
                t.join()
            self.wait_readmitted(orch, "draft", "D")
            if hit["stats"] is None or hit["stats"].deadline_misses:
                break
        return dict(drafts=1 if orch == "one" else 2, proposer=proposer, prompt=prompt,
                    unfrozen_s=base["seconds"], target_only_s=alone["seconds"], frozen_s=hit["seconds"],
                    extra_s=hit["seconds"] - base["seconds"],
                    extra_vs_target_only_s=hit["seconds"] - alone["seconds"],
                    identical=hit["tokens"] == ref[prompt] == base["tokens"],
                    deadline_misses=hit["stats"].deadline_misses if hit["stats"] else None,
                    # the rounds that waited on the frozen draft: what the freeze itself cost
                    missed_rounds_ms=[r.total_ms for r in hit["stats"].rounds if r.deadline_misses]
                    if hit["stats"] else None,
                    error=hit["error"])

    def _pair(self, prompts: list[str], fault=None) -> list[dict]:
        results: list[dict] = [{} for _ in prompts]
        firsts = threading.Barrier(len(prompts), action=fault) if fault else None

        def run(i: int) -> None:
            results[i] = stream(self.addr["two"], prompts[i], proposer="draft",
                                on_first=(lambda: firsts.wait()) if firsts else None)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def target_frozen(self, ref: dict) -> list[dict]:
        rows = []
        for pair in (PROMPTS[2:4], PROMPTS[4:6]):
            self._pair(pair)  # warm
            base = self._pair(pair)
            timers = []
            hit = self._pair(pair, fault=lambda: timers.append(freeze(self.pid("A"), self.args.freeze_s)))
            for t in timers:
                t.join()
            self.wait_readmitted("two", "target", "A")
            for b, h in zip(base, hit):
                moved = bool(h["stats"] and h["stats"].deadline_misses)
                rows.append(dict(prompt=h["prompt"], on_frozen=moved, unfrozen_s=b["seconds"],
                                 frozen_s=h["seconds"], extra_s=h["seconds"] - b["seconds"],
                                 identical=h["tokens"] == ref[h["prompt"]], error=h["error"]))
        return rows

    def target_slow(self) -> dict:
        placed: list[tuple[float, str]] = []
        ejected_at = None
        with Client(self.addr["two"], timeout=300) as c:
            for p in PROMPTS[:4]:  # both targets' usual latencies, side by side
                c.complete(p, max_new_tokens=8, proposer="none")
            with Throttle(self.pid("B")):
                started = time.monotonic()
                while time.monotonic() - started < 30.0:
                    done = c.complete(PROMPTS[len(placed) % len(PROMPTS)], max_new_tokens=8, proposer="none")
                    now = time.monotonic() - started
                    placed.append((now, done.stats.target_replica))
                    if ejected_at is None and metric(self.metrics["two"], "specdec_replica_ejected",
                                                     role="target", address=self.addr["B"]):
                        ejected_at = now
                    if ejected_at is not None and now > ejected_at + 10.0:
                        break
                    time.sleep(0.3)
        self.wait_readmitted("two", "target", "B")
        after = [r for t, r in placed if ejected_at is not None and t > ejected_at]
        return dict(ejected_after_s=ejected_at, sessions=len(placed),
                    on_slow_before=sum(r == self.addr["B"] for t, r in placed if ejected_at is None or t <= ejected_at),
                    on_slow_after=sum(r == self.addr["B"] for r in after), after=len(after))

    def overload(self, ref: dict) -> dict:
        unloaded = [stream(self.addr["one"], p) for p in PROMPTS]
        gaps0 = [g for r in unloaded for g in r["gaps"]]
        measured = lambda: metric(self.metrics["one"], "specdec_target_capacity_sessions",  # noqa: E731
                                  address=self.addr["A"])
        cap = int(measured() or 1)
        for _ in range(2):  # a warm-up at the capacity teaches the cost of batched forwards
            self._load(cap, seconds=max(10.0, self.args.overload_s / 4))
            cap = int(measured() or cap)
        admitted, refused, hung = self._load(4 * cap, seconds=self.args.overload_s)
        gaps = [g for r in admitted for g in r["gaps"]]
        refusal_s = [r["seconds"] for r in refused]
        wrong = [r for r in admitted if r["tokens"] != ref[r["prompt"]]]
        return dict(capacity=cap, clients=4 * cap, unloaded_p99_gap_ms=p99(gaps0) * 1e3,
                    admitted=len(admitted), admitted_p99_gap_ms=p99(gaps) * 1e3,
                    ratio=p99(gaps) / p99(gaps0) if gaps0 else None, refused=len(refused),
                    refusal_p99_ms=p99(refusal_s) * 1e3 if refusal_s else None,
                    refusal_max_ms=max(refusal_s) * 1e3 if refusal_s else None,
                    refusal_limits=sorted({r["error"][1].split(":")[0] for r in refused}),
                    hung=hung, wrong_tokens=len(wrong),
                    other_errors=[r["error"] for r in admitted if r["error"]])

    def _load(self, clients: int, *, seconds: float):
        admitted, refused = [], []
        lock = threading.Lock()
        end = time.monotonic() + seconds

        def client(i: int) -> None:
            n = 0
            with Client(self.addr["one"], timeout=300, retries=0) as c:  # one channel per client
                while time.monotonic() < end:
                    r = stream(c, PROMPTS[(i + n) % len(PROMPTS)])
                    n += 1
                    self._book(r, lock, admitted, refused)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 300)
        hung = sum(t.is_alive() for t in threads)
        return admitted, refused, hung

    @staticmethod
    def _book(r: dict, lock: threading.Lock, admitted: list, refused: list) -> None:
        with lock:
            if r["error"] and r["error"][0] == "RESOURCE_EXHAUSTED":
                refused.append(r)
            else:
                admitted.append(r)
        if r["error"]:
            time.sleep(0.2)  # a refused client backs off a little, as Retry-After asks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random test models (a quick check)")
    p.add_argument("--target", default=None, help="target model (default: the embedded one)")
    p.add_argument("--draft", default=None, help="draft model (default: the shipped draft)")
    p.add_argument("--freeze-s", type=float, default=20.0)
    p.add_argument("--overload-s", type=float, default=60.0)
    p.add_argument("--scenarios", default="draft-frozen,target-frozen,target-slow,overload")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("docs/bench-gray"))
    args = p.parse_args(argv)
    workdir = prepare_run(args, "specdec-gray-")
    bench = Bench(args, workdir)
    results: dict = {"freeze_s": args.freeze_s, "models": "tiny" if args.tiny else "embedded"}
    try:
        bench.start()
        ref = bench.references()
        todo = args.scenarios.split(",")
        if "draft-frozen" in todo:
            results["draft_frozen"] = bench.draft_frozen(ref)
        if "target-frozen" in todo:
            results["target_frozen"] = bench.target_frozen(ref)
        if "target-slow" in todo:
            results["target_slow"] = bench.target_slow()
        if "overload" in todo:
            results["overload"] = bench.overload(ref)
    finally:
        bench.stop()
    report(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


def report(r: dict) -> None:
    print(f"\n== gray failures and overload ({r['models']} models; freezes {r['freeze_s']:g} s) ==")
    for row in r.get("draft_frozen", []):
        print(f"draft frozen ({row['drafts']} draft(s)), proposer {row['proposer']:8s}: {row['unfrozen_s']:.2f} s "
              f"-> {row['frozen_s']:.2f} s ({row['extra_s']:+.2f} s; target-only {row['target_only_s']:.2f} s, "
              f"{row['extra_vs_target_only_s']:+.2f} s), identical {row['identical']}, deadline misses "
              f"{row['deadline_misses']} (their rounds {[round(m) for m in row['missed_rounds_ms'] or []]} ms), "
              f"error {row['error']}")
    for row in r.get("target_frozen", []):
        print(f"target frozen, {'on it ' if row['on_frozen'] else 'on the other'}: {row['unfrozen_s']:.2f} s -> "
              f"{row['frozen_s']:.2f} s ({row['extra_s']:+.2f} s), identical {row['identical']}, error {row['error']}")
    if "target_slow" in r:
        s = r["target_slow"]
        print(f"target slowed 5x: ejected after {s['ejected_after_s']} s; sessions on it before "
              f"{s['on_slow_before']}, after {s['on_slow_after']} of {s['after']}")
    if "overload" in r:
        o = r["overload"]
        print(f"overload: capacity {o['capacity']}, {o['clients']} clients; p99 gap unloaded "
              f"{o['unloaded_p99_gap_ms']:.0f} ms, admitted {o['admitted_p99_gap_ms']:.0f} ms "
              f"({o['ratio']:.2f}x); admitted {o['admitted']}, refused {o['refused']} "
              f"(p99 {o['refusal_p99_ms']} ms, max {o['refusal_max_ms']} ms, {o['refusal_limits']}); "
              f"hung {o['hung']}, wrong tokens {o['wrong_tokens']}, other errors {o['other_errors']}")


if __name__ == "__main__":
    sys.exit(main())

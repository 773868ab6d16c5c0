"""First-token latency of ordinary streams while another client sends huge prompts.

    python -m benchmarks.faults.attack_bench [--mb 8] [--victims 60] [--json out.json]
    python -m benchmarks.faults.attack_bench --gateway-only [--gateway-body-mb 100]
    python -m benchmarks.faults.attack_bench --bounds-only [--tiny] [--runs 5]
    python -m benchmarks.faults.attack_bench --flood-only [--flood-requests 12] [--flood-mb 4]

Tiny target + draft + orchestrator (loopback). One task sends short greedy
Generates back to back and times each one's first chunk; phases alternate
between quiet and "attack" (another client sends --mb MB prompts in a loop),
and the script reports p50/p99 first-token time in each and the p99 delay.
Two attack modes: with the default --max-request-bytes (the prompt is refused
before tokenising) and with the cap raised above the prompt (it is tokenised,
on the orchestrator's text thread pool, and refused as too long for the
context). Goal: the p99 delay <= 50 ms.

The gateway entry (benchmarks.faults.gateway_attack): a --gateway-body-mb MB request body, declared
and chunked, against the gateway's body limit. Goal: 413 within 1 s, gateway memory growth
<= 20 MB.

The flood entry (benchmarks.faults.gateway_attack.run_flood, --flood-only): concurrent 4 MB
requests to a gateway whose orchestrator requires tokens, without one, with one nobody holds, and
with a real one (the control). Goal: all 401 / 403, gateway memory growth <= 30 MB.

The bounds entry (benchmarks.faults.bounds_attack, --bounds or --bounds-only): 100,000 stop
strings, a 1 MB prediction, a 1 MB JSON Schema, each refused with a clear error or served with
another stream's worst chunk gap at most 1.5x its gap alone; with the default bounds and with
every bound off.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _victim_ttfts(address: str, n: int) -> list[float]:
    from client import AsyncClient

    out = []
    async with AsyncClient(address, timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            async for _ in c.generate(f"hello number {i}", max_new_tokens=4, proposer="none"):
                out.append((time.perf_counter() - t0) * 1e3)
                break
    return out


def _attacker(address: str, payload: str, stop: threading.Event, outcomes: list) -> None:
    import grpc

    from client import Client

    with Client(address, timeout=120) as c:
        while not stop.is_set():
            try:
                c.complete(payload, max_new_tokens=1)
                outcomes.append("OK")
            except grpc.RpcError as exc:
                outcomes.append(exc.code().name)


def run(args: argparse.Namespace) -> dict:
    from specdec.runtime import procs
    from specdec.runtime.launch import Processes, child_env, orchestrator_argv, service_argv
    from tests.tiny import build_pair

    work = Path(tempfile.mkdtemp(prefix="specdec-attack-"))
    target, draft = build_pair(work / "models")
    (work / "logs").mkdir()
    payload = "attack " * (args.mb * (1 << 20) // 7)
    results = {}
    for mode, cap in (("refused before tokenising (default cap)", None),
                      ("tokenised off the event loop (cap raised)", 2 * args.mb << 20)):
        group = Processes(work / "logs", env=child_env(1, quiet=True))
        try:
            ports = {"target": procs.free_port(), "draft": procs.free_port()}
            for role, model in (("target", target), ("draft", draft)):
                group.serve(role, service_argv(role, ports[role], model=model, threads=1), ports[role])
            port = procs.free_port()
            extra = ("--rate-per-tenant", "0", "--max-streams-per-tenant", "0")
            if cap:
                extra += ("--max-request-bytes", str(cap))
            address = group.serve("orch", orchestrator_argv(
                port, tokenizer=target, targets=[f"127.0.0.1:{ports['target']}"],
                drafts=[f"127.0.0.1:{ports['draft']}"], extra=extra), port)
            asyncio.run(_victim_ttfts(address, 5))  # warm up
            quiet, attack, outcomes = [], [], []
            for _ in range(args.rounds):
                quiet += asyncio.run(_victim_ttfts(address, args.victims // args.rounds))
                stop = threading.Event()
                thread = threading.Thread(target=_attacker, args=(address, payload, stop, outcomes))
                thread.start()
                time.sleep(0.5)  # the first huge request is on its way
                attack += asyncio.run(_victim_ttfts(address, args.victims // args.rounds))
                stop.set()
                thread.join()
            results[mode] = {
                "quiet_p50_ms": statistics.median(quiet), "quiet_p99_ms": _pct(quiet, 0.99),
                "attack_p50_ms": statistics.median(attack), "attack_p99_ms": _pct(attack, 0.99),
                "p99_delay_ms": _pct(attack, 0.99) - _pct(quiet, 0.99),
                "huge_requests": len(outcomes), "huge_outcomes": sorted(set(outcomes)),
            }
        finally:
            group.stop_all()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=8, help="size of each huge prompt, MB")
    p.add_argument("--victims", type=int, default=120, help="ordinary streams per phase kind")
    p.add_argument("--rounds", type=int, default=4, help="quiet/attack phase pairs")
    p.add_argument("--gateway-body-mb", type=int, default=100,
                   help="size of the body sent to the gateway, MB (0 = skip that entry)")
    p.add_argument("--gateway-only", action="store_true", help="run the gateway entry alone")
    p.add_argument("--bounds", action="store_true", help="also run the bounds entry (bounds_attack)")
    p.add_argument("--bounds-only", action="store_true", help="run the bounds entry alone")
    p.add_argument("--runs", type=int, default=5, help="bounds entry: victim streams per measurement")
    p.add_argument("--tiny", action="store_true", help="bounds entry: the tiny test models, not the embedded")
    p.add_argument("--flood-only", action="store_true", help="run the anonymous flood entry alone")
    p.add_argument("--flood-requests", type=int, default=12, help="flood entry: concurrent requests")
    p.add_argument("--flood-mb", type=float, default=4.0, help="flood entry: each body's size, MB")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.flood_only:
        from benchmarks.faults import gateway_attack

        flood = gateway_attack.run_flood(args.flood_requests, args.flood_mb)
        for name, r in flood.items():
            counts = {s: r["statuses"].count(s) for s in dict.fromkeys(r["statuses"])}
            print(f"{r['requests']} concurrent {r['body_mb']:g} MB requests, {name}: statuses "
                  f"{', '.join(f'{s} x{n}' for s, n in counts.items())}; slowest answer "
                  f"{r['worst_seconds']:.2f} s; gateway memory growth {r['rss_growth_mb']:.1f} MB")
        if args.json:
            Path(args.json).write_text(json.dumps(flood, indent=2))
        return 0
    results = {} if args.gateway_only or args.bounds_only else run(args)
    for mode, r in results.items():
        print(f"{args.mb} MB prompts, {mode}: first token p50 {r['quiet_p50_ms']:.1f} -> "
              f"{r['attack_p50_ms']:.1f} ms, p99 {r['quiet_p99_ms']:.1f} -> {r['attack_p99_ms']:.1f} ms "
              f"(p99 delay {r['p99_delay_ms']:+.1f} ms; {r['huge_requests']} huge requests: "
              f"{', '.join(r['huge_outcomes'])})")
    if args.bounds or args.bounds_only:
        from benchmarks.faults import bounds_attack

        results["bounds"] = bounds_attack.run(args.runs, tiny=args.tiny)
        bounds_attack.report(results["bounds"])
    if args.gateway_body_mb and not args.bounds_only:
        from benchmarks.faults import gateway_attack

        body = gateway_attack.run(args.gateway_body_mb)
        results["gateway body limit"] = body
        for mode, r in body.items():
            print(f"{args.gateway_body_mb} MB body to the gateway ({mode}): status "
                  f"{'/'.join(map(str, r['statuses']))} after at most {r['worst_seconds'] * 1e3:.0f} ms, "
                  f"gateway memory growth at most {r['worst_rss_growth_mb']:.1f} MB "
                  f"(the client got {r['most_sent_mb']:.1f} MB out before the answer)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

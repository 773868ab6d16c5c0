"""One tenant opens every stream it can and never reads them; does another tenant get in?

    python -m benchmarks.faults.tenant_flood [--streams 64] [--shares 0.5,1] [--json out.json]

A tiny target and an orchestrator that requires tokens (tenants alice and bob), once per
--tenant-share. Alice opens --streams streams at once (long, ignore_eos, 20 log-probabilities a
token so each chunk is large) and reads none of them past their first chunk. Once every one of
hers is admitted or refused, bob sends one stream. The figures: how many of alice's were
admitted and why the rest were refused, whether bob was admitted, and the seconds from his
request to his first chunk. Goal (issue 49): bob admitted within 2 s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc

PROMPT = "one two three four five six seven eight"


async def _flood(address: str, tokens: dict[str, str], streams: int) -> dict:
    from client import build_request
    from specdec.v1 import orchestrator_pb2_grpc

    def metadata(tenant: str):
        return (("authorization", f"Bearer {tokens[tenant]}"),)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = build_request(PROMPT, max_new_tokens=400, ignore_eos=True, logprobs=True, top_logprobs=20)
        calls = [stub.Generate(request, metadata=metadata("alice"), timeout=120) for _ in range(streams)]

        async def first(call) -> str:
            try:
                await call.read()
                return "admitted"
            except grpc.RpcError as exc:
                return exc.details().split(":", 1)[0] if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED \
                    else exc.code().name

        outcomes = await asyncio.gather(*(first(c) for c in calls))
        started = time.perf_counter()
        bob = stub.Generate(build_request(PROMPT, max_new_tokens=8), metadata=metadata("bob"), timeout=60)
        try:
            await bob.read()
            bob_outcome, bob_s = "admitted", time.perf_counter() - started
        except grpc.RpcError as exc:
            bob_outcome, bob_s = f"{exc.code().name}: {exc.details()[:80]}", time.perf_counter() - started
        held_open = sum(1 for c in calls if not c.done())  # alice's streams still open when bob asked
        for c in calls:
            c.cancel()
        bob.cancel()
    counts = {o: outcomes.count(o) for o in dict.fromkeys(outcomes)}
    return {"alice": counts, "alice_open_at_bob": held_open, "bob": bob_outcome, "bob_first_chunk_s": bob_s}


def run(streams: int, shares: list[float], capacity: int = 0) -> dict:
    """The flood once per share; `capacity`: --target-capacity (0 = measured, the batch size)."""
    import secrets

    from specdec.runtime import procs
    from specdec.runtime.launch import Processes, child_env, orchestrator_argv, service_argv
    from tests.tiny import build_pair

    work = Path(tempfile.mkdtemp(prefix="specdec-tenant-flood-"))
    target, _ = build_pair(work / "models")
    tokens = {t: secrets.token_urlsafe(16) for t in ("alice", "bob")}
    (work / "tokens").write_text("".join(f"{t}:{k}\n" for t, k in tokens.items()))
    results = {}
    for share in shares:
        logs = work / f"logs-{share:g}"
        logs.mkdir()
        group = Processes(logs, env=child_env(1, quiet=True))
        try:
            tport, oport = procs.free_port(), procs.free_port()
            group.serve("target", service_argv("target", tport, model=target, threads=1), tport)
            orch = group.serve("orch", orchestrator_argv(oport, tokenizer=target, targets=[f"127.0.0.1:{tport}"], extra=(
                "--auth-tokens", str(work / "tokens"), "--tenant-share", f"{share:g}",
                "--max-streams-per-tenant", "0", "--rate-per-tenant", "0", "--max-in-flight", "0",
                "--target-capacity", str(capacity))), oport)
            results[f"{share:g}"] = asyncio.run(_flood(orch, tokens, streams))
        finally:
            group.stop_all()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64, help="alice's streams")
    p.add_argument("--shares", default="0.5,1", help="--tenant-share values to run, comma-separated")
    p.add_argument("--capacity", type=int, default=0, help="--target-capacity (0 = the target's batch size)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = run(args.streams, [float(s) for s in args.shares.split(",")], args.capacity)
    for share, r in results.items():
        print(f"--tenant-share {share}: alice's {args.streams} streams "
              f"{', '.join(f'{o} x{n}' for o, n in r['alice'].items())} ({r['alice_open_at_bob']} still open "
              f"when bob asked); bob {r['bob']} after {r['bob_first_chunk_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

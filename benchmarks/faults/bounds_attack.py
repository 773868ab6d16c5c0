"""Another stream's worst chunk gap while a client sends requests that ask for unbounded work.

    python -m benchmarks.faults.attack_bench --bounds-only [--tiny] [--runs 5] [--json out.json]

The attacks (issue 41): 100,000 stop strings, a 1 MB prediction the model does not follow, a
1 MB JSON Schema; each with a 64-token greedy answer. A victim streams 64 greedy tokens (default
proposer) and records its worst gap between two chunks: `--runs` times alone, then `--runs`
times while another process sends the attack back to back. Two orchestrators on the same
target and draft: the default bounds, and every bound off (--max-request-bytes 4 MiB), so the
figures show what each bound protects. Goal: each attack refused with a clear error, or served
with the victim's worst gap (median over the runs) at most 1.5x its gap alone. The control is
the same back-to-back load of ordinary 64-token requests: what any concurrent stream costs the
victim on this machine (a served attack can cost no less). The embedded target and the shipped
draft by default (as the issue measured), the tiny test models with --tiny.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

VICTIM_PROMPT = "Write a short story about a lighthouse keeper and a storm."
ATTACK_PROMPT = "Summarise the history of the printing press."
TOKENS = 64
# Two tenants (--auth-tokens): the attacker's refusals and rate limit are its own.
CREDENTIALS = {"victim": "victim-token-0123456789", "attacker": "attacker-token-0123456789"}
BOUNDS_OFF = ("--max-stop-strings", "0", "--max-stop-bytes", "0", "--max-prediction-bytes", "0",
              "--max-grammar-bytes", "0", "--max-request-bytes", str(4 << 20))
ATTACKS = ("100k stop strings", "1 MB prediction", "1 MB grammar")
CONTROL = "an ordinary request"  # the same back-to-back load without the attack's fields


def attack_fields(name: str) -> dict:
    """The build_request keywords of one attack (about 0.6 MB, 1 MB, 1 MB of text)."""
    if name == CONTROL:
        return {}
    if name == "100k stop strings":
        return {"stop": [f"~{i}" for i in range(100_000)]}
    if name == "1 MB prediction":  # words the model does not write in this order
        rng = random.Random(41)
        words = ["harbor", "quartz", "velvet", "orbit", "lantern", "meadow", "cipher", "tundra"]
        text, size = [], 0
        while size < 1_000_000:
            text.append(rng.choice(words))
            size += len(text[-1]) + 1
        return {"prediction": " ".join(text)[:1_000_000]}
    props, size, i = {}, 0, 0
    while size < 1_000_000 - 200:  # a JSON Schema with enough properties to weigh 1 MB
        prop = {"type": "string", "enum": [f"value_{i}_{j}" for j in range(4)]}
        size += len(json.dumps({f"field_{i}": prop})) - 1
        props[f"field_{i}"] = prop
        i += 1
    return {"json_schema": json.dumps({"type": "object", "properties": props})}


def _attacker(address: str, name: str, stop, out) -> None:
    """Send the attack back to back until `stop` (a process of its own: its 1 MB messages are
    serialized here, not in the victim's process); then one summary on `out`: (status code,
    message of the first, seconds) per attack."""
    import grpc

    from client import Client

    fields = attack_fields(name)
    fields.setdefault("ignore_eos", "json_schema" not in fields)  # a grammar ends at its EOS
    outcomes: list[tuple[str, str, float]] = []
    with Client(address, timeout=300, token=CREDENTIALS["attacker"]) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                client.complete(ATTACK_PROMPT, max_new_tokens=TOKENS, **fields)
                code, message = "OK", ""
            except grpc.RpcError as exc:
                code, message = exc.code().name, exc.details() or ""
            seen = any(known == code for known, _, _ in outcomes)
            outcomes.append((code, "" if seen else message, time.perf_counter() - started))
            if code == "RESOURCE_EXHAUSTED":
                time.sleep(0.2)  # rate-limited: back off as Retry-After asks
    out.put(outcomes)


async def _worst_gap(address: str) -> float:
    """One victim stream's worst gap between two chunks, in seconds."""
    from client import AsyncClient

    gaps, last = [], None
    async with AsyncClient(address, timeout=300, token=CREDENTIALS["victim"]) as c:
        async for _ in c.generate(VICTIM_PROMPT, max_new_tokens=TOKENS, ignore_eos=True):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return max(gaps) if gaps else 0.0


def _victims(address: str, runs: int) -> list[float]:
    gaps = [asyncio.run(_worst_gap(address)) for _ in range(runs)]
    print(f"  victim worst gaps: {', '.join(f'{g:.3f}' for g in gaps)} s", file=sys.stderr, flush=True)
    return gaps


def _under_attack(address: str, name: str, runs: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_attacker, args=(address, name, stop, out), daemon=True)
    proc.start()
    time.sleep(2.0)  # the first attack request is in (its 1 MB built and sent)
    gaps = _victims(address, runs)
    stop.set()
    outcomes = out.get(timeout=900)  # before join: a child exits once its queue is drained
    proc.join(60)
    return {"gaps_s": gaps, "attacks": len(outcomes),
            "outcomes": sorted({code for code, _, _ in outcomes}),
            "message": next((m for code, m, _ in outcomes if code == "INVALID_ARGUMENT"), ""),
            "attack_s": statistics.median([s for code, _, s in outcomes if code in ("OK", "INVALID_ARGUMENT")] or [0.0])}


def _verdict(alone: list[float], attacked: dict) -> dict:
    ratio = statistics.median(attacked["gaps_s"]) / max(1e-9, statistics.median(alone))
    refused = attacked["outcomes"] and "OK" not in attacked["outcomes"] and attacked["message"]
    return {**attacked, "gap_ratio": ratio,
            "met": bool(refused) or ratio <= 1.5, "how": "refused" if refused else "served"}


def run(runs: int = 5, tiny: bool = False, redis_url: str = "redis://127.0.0.1:6379/0") -> dict:
    from specdec.runtime import procs
    from specdec.runtime.launch import Processes, child_env, orchestrator_argv, service_argv
    from specdec.runtime.store import delete_prefix

    work = Path(tempfile.mkdtemp(prefix="specdec-bounds-"))
    (work / "logs").mkdir()
    target = draft = None
    if tiny:
        from tests.tiny import build_pair

        target, draft = build_pair(work / "models")
    group = Processes(work / "logs", env=child_env(1, quiet=True, SPECDEC_REDIS_URL=""))
    prefix = f"specdec-bounds-bench-{int(time.time())}:"  # its own keys, deleted at the end
    tokens = work / "tokens"
    tokens.write_text("".join(f"{tenant}:{token}\n" for tenant, token in CREDENTIALS.items()))
    results: dict = {"models": "tiny" if tiny else "embedded", "runs": runs, "tokens": TOKENS}
    try:
        ports = {role: procs.free_port() for role in ("target", "draft")}
        for role, model in (("target", target), ("draft", draft)):
            group.serve(role, service_argv(role, ports[role], model=model, threads=1), ports[role],
                        timeout=600)
        for config, name, extra in (("default bounds", "orch-default", ()),
                                    ("bounds off", "orch-off", BOUNDS_OFF)):
            port = procs.free_port()
            address = group.serve(name, orchestrator_argv(
                port, tokenizer=target, targets=[f"127.0.0.1:{ports['target']}"],
                drafts=[f"127.0.0.1:{ports['draft']}"], redis_url=redis_url, redis_prefix=prefix,
                extra=("--auth-tokens", str(tokens), *extra)), port)
            _victims(address, 2)  # warm up
            alone = _victims(address, runs)
            results[config] = {"alone_gaps_s": alone}
            for attack in (CONTROL, *ATTACKS) if config == "default bounds" else ATTACKS:
                print(f"{config}: {attack}", file=sys.stderr, flush=True)
                results[config][attack] = _verdict(alone, _under_attack(address, attack, runs))
            group.stop(name)
    finally:
        group.stop_all()
        asyncio.run(delete_prefix(redis_url, prefix))
    return results


def report(results: dict) -> None:
    for config in ("default bounds", "bounds off"):
        r = results[config]
        alone = statistics.median(r["alone_gaps_s"])
        print(f"{config}: the victim's worst chunk gap alone {alone:.3f} s (median of {results['runs']})")
        for name in (CONTROL, *ATTACKS) if CONTROL in r else ATTACKS:
            a = r[name]
            what = (f"refused: {a['message']!r}" if a["how"] == "refused"
                    else f"served in {a['attack_s']:.1f} s ({', '.join(a['outcomes'])})")
            print(f"  {name}: {what}; victim's worst gap {statistics.median(a['gaps_s']):.3f} s "
                  f"({a['gap_ratio']:.2f}x alone) -> {'met' if a['met'] else 'missed'}")

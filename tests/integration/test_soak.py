"""Soak: steady mixed load for minutes (hours on demand); memory flat, nothing leaked, every stream right.

One stack of its own (target, draft, orchestrator, each with a metrics port;
real Redis under a private prefix). WORKERS client threads loop until the
time is up, each request drawn from a seeded mix: greedy single-turn with
every proposer (draft, lookup, guess, none, combined), seeded sampling
(draft, lookup, none at a fixed k, and the default configuration: default
proposer, the gate, the server's k), a kept two-turn session ended with
EndSession, and a stream cancelled after a few tokens. Checks:

  * every greedy stream equals the target-only text of its prompt; every
    sampled one equals target-only decoding of its (prompt, seed), whatever
    proposed at whichever k; every finished stream has as many tokens as it
    streamed; a worker records every exception it meets (not only RPC
    errors) and goes on;
  * the RSS of each process after warm-up grows by at most 5 % (the highest
    reading in the last window against the highest in the window after
    warm-up);
  * at the end no KV session is left on either service (their
    `specdec_active_sessions` and `specdec_cache_bytes` are 0), no kept
    session's record is left in Redis, and every key left under the prefix
    is a registry entry or a cancelled single-turn record with its short TTL.

SPECDEC_SOAK_MINUTES sets the load's length (default 1.5, the CI variant);
SPECDEC_SOAK_EMBEDDED=1 runs it on the embedded target and the shipped draft
instead of the tiny test models; SPECDEC_SOAK_SEED picks the mix.
"""
from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import grpc
import pytest
import redis

from client import Client
from specdec.runtime import procs
from specdec.runtime.store import SINGLE_TURN_TTL_S
from tests.integration.faults import PROMPTS
from tests.integration.stack import Stack
from tests.integration.test_gateway import scrape

MINUTES = float(os.environ.get("SPECDEC_SOAK_MINUTES", "1.5"))
EMBEDDED = os.environ.get("SPECDEC_SOAK_EMBEDDED", "") not in ("", "0")
SEED = int(os.environ.get("SPECDEC_SOAK_SEED", "5"))
WORKERS = 3
MAX_NEW = 24 if EMBEDDED else 48
SAMPLE_S = 5.0  # RSS readings
WINDOW_S = 20.0 if MINUTES <= 5 else 120.0  # the windows compared
RSS_GROWTH = 0.05
GREEDY_KINDS = ("draft", "lookup", "guess", "none", "combined")
SAMPLED_KINDS = ("draft", "lookup", "none", "default")
SAMPLING = dict(temperature=0.8, top_p=0.95)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def soak(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = (None, None) if EMBEDDED else tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("soak-logs"))
    stack.metrics = {}
    try:
        for role, folder in (("target", target_dir), ("draft", draft_dir)):
            stack.metrics[role] = procs.free_port()
            stack.start_service(role, role, folder, extra=("--metrics-port", str(stack.metrics[role])),
                                wait=False)
        stack.wait_serving("target", "draft")
        stack.metrics["orch"] = procs.free_port()
        # Suffix decoding's cache (the default proposer's source) is bounded small, so it fills and
        # evicts within the warm-up: flat RSS afterwards then also says the bound holds.
        stack.start_orchestrator("orch", target_dir, extra=("--metrics-port", str(stack.metrics["orch"]),
                                                            "--suffix-cache-tokens", "1000"))
        yield stack
    finally:
        stack.stop()


class Mix:
    """What the workers share: references, outcomes, failures."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.greedy: dict[str, tuple[tuple[int, ...], str]] = {}  # prompt -> target-only (ids, text)
        self.sampled: dict[tuple, tuple[int, ...]] = {}  # (prompt, seed) -> target-only ids
        self.counts: dict[str, int] = defaultdict(int)
        self.failures: list[str] = []
        self.cancelled = 0
        self.kept: list[str] = []

    def reference(self, prompt: str) -> tuple[tuple[int, ...], str]:
        with self.lock:
            known = self.greedy.get(prompt)
        if known is None:
            done = self.client.complete(prompt, max_new_tokens=MAX_NEW, proposer="none")
            known = (tuple(done.token_ids), done.text)
            with self.lock:
                self.greedy.setdefault(prompt, known)
        return known

    def sampled_reference(self, prompt: str, seed: int) -> tuple[int, ...]:
        with self.lock:
            known = self.sampled.get((prompt, seed))
        if known is None:
            done = self.client.complete(prompt, max_new_tokens=MAX_NEW, proposer="none", seed=seed, **SAMPLING)
            known = tuple(done.token_ids)
            with self.lock:
                self.sampled.setdefault((prompt, seed), known)
        return known

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.counts[what] += 1
            if not ok:
                self.failures.append(f"{what}: {detail}")


def _one(mix: Mix, rng: random.Random) -> None:
    c = mix.client
    prompt = rng.choice(PROMPTS)
    roll = rng.random()
    if roll < 0.45:
        kind = rng.choice(GREEDY_KINDS)
        ids, text = mix.reference(prompt)
        guess = text[: max(1, len(text) // 2)] if kind == "guess" else ""
        done = c.complete(prompt, max_new_tokens=MAX_NEW, proposer=kind, k=rng.randint(0, 4), guess=guess)
        mix.check(f"greedy {kind}", tuple(done.token_ids) == ids, prompt)
    elif roll < 0.7:
        kind, k, seed = rng.choice(SAMPLED_KINDS), rng.randint(1, 3), rng.randint(1, 3)
        if kind == "default":
            k = 0  # the server's k, the gate's choice
        done = c.complete(prompt, max_new_tokens=MAX_NEW, proposer=kind, k=k, seed=seed, **SAMPLING)
        want = mix.sampled_reference(prompt, seed)
        mix.check(f"sampled {kind}", tuple(done.token_ids) == want, str((prompt, kind, k, seed)))
    elif roll < 0.85:
        first = c.complete(prompt, max_new_tokens=MAX_NEW // 2, keep_session=True,
                           proposer=rng.choice(("combined", "draft")))
        sid = first.stats.session_id
        with mix.lock:
            mix.kept.append(sid)
        turn2 = prompt + first.text + " and then"
        second = c.complete(turn2, max_new_tokens=MAX_NEW // 2, session_id=sid)
        ref = c.complete(turn2, max_new_tokens=MAX_NEW // 2, proposer="none")
        mix.check("two turns", second.token_ids == ref.token_ids
                  and second.stats.reused_prompt_tokens > 0, prompt)
        mix.check("end session", c.end_session(sid), sid)
    else:
        stream, got = c.generate(prompt, max_new_tokens=MAX_NEW, proposer=rng.choice(GREEDY_KINDS[:2])), 0
        for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 4:
                stream.cancel()
                break
        with mix.lock:
            mix.cancelled += 1
        mix.check("cancelled", True)


# The suite's per-test timeout (600 s) would cut a long soak short: its own bound is the load's
# length plus start-up and the final checks.
@pytest.mark.timeout(int(MINUTES * 60) + 900)
def test_a_soak_keeps_memory_flat_leaks_nothing_and_every_stream_is_right(soak):
    duration = MINUTES * 60.0
    warmup = min(60.0, duration / 3)
    pids = {name: soak.procs[name].pid for name in ("target", "draft", "orch")}
    readings: list[tuple[float, dict[str, int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            readings.append((time.monotonic(), {n: _rss_kb(p) for n, p in pids.items()}))
            stop.wait(SAMPLE_S)

    with Client(soak.addresses["orch"], timeout=300) as client:
        mix = Mix(client)
        started = time.monotonic()
        end = started + duration

        def worker(i: int) -> None:
            rng = random.Random(SEED * 100 + i)
            while time.monotonic() < end:
                try:
                    _one(mix, rng)
                except grpc.RpcError as exc:
                    mix.check("rpc", False, f"{exc.code().name}: {exc.details()}")
                except Exception as exc:  # noqa: BLE001 - recorded, never a silently stopped worker
                    mix.check("exception", False, f"{type(exc).__name__}: {exc}")

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + 300)
        stop.set()
        sampler.join(10)
        readings.append((time.monotonic(), {n: _rss_kb(p) for n, p in pids.items()}))

    def kv_held() -> dict[str, tuple[float, float]]:
        return {role: (scrape(soak.metrics[role])["specdec_active_sessions"],
                       scrape(soak.metrics[role])["specdec_cache_bytes"]) for role in ("target", "draft")}

    # Releases of cancelled streams land in the background: wait for them (bounded), not a fixed time.
    released = {"target": (0.0, 0.0), "draft": (0.0, 0.0)}
    deadline = time.monotonic() + 30
    while (kv := kv_held()) != released and time.monotonic() < deadline:
        time.sleep(0.1)
    r = redis.Redis.from_url(soak.redis_url)
    keys = {k.decode(): r.ttl(k) for k in r.scan_iter(match=f"{soak.prefix}*", count=1000)}
    sessions = {k: ttl for k, ttl in keys.items() if k.startswith(f"{soak.prefix}session:")}
    stray = [k for k, ttl in keys.items() if ttl < 0 or (k in sessions and ttl > SINGLE_TURN_TTL_S)]
    kept_left = [sid for sid in mix.kept if f"{soak.prefix}session:{sid}" in sessions]

    def peak(lo: float, hi: float) -> dict[str, int]:
        window = [rss for t, rss in readings if lo <= t - started <= hi]
        return {n: max(w[n] for w in window) for n in pids}

    after_warmup = peak(warmup, warmup + WINDOW_S)
    last = peak(duration - WINDOW_S, duration + 60)
    growth = {n: last[n] / after_warmup[n] - 1 for n in pids}
    total = sum(mix.counts.values())
    print(f"\nsoak {MINUTES:g} min ({'embedded' if EMBEDDED else 'tiny'} models): {total} requests "
          f"{dict(mix.counts)}; RSS after warm-up -> end (MB): "
          + ", ".join(f"{n} {after_warmup[n] / 1024:.0f} -> {last[n] / 1024:.0f} ({growth[n]:+.1%})" for n in pids)
          + f"; KV left {kv}; Redis keys left {len(keys)} ({len(sessions)} cancelled single-turn "
          f"records of {mix.cancelled} cancels), stray {len(stray)}")
    assert not mix.failures, mix.failures[:10]
    assert all(mix.counts[f"greedy {k}"] for k in GREEDY_KINDS) and mix.counts["two turns"]
    assert mix.counts["sampled default"]
    assert all(growth[n] <= RSS_GROWTH for n in pids), growth
    assert kv == {"target": (0.0, 0.0), "draft": (0.0, 0.0)}
    assert not stray and not kept_left and len(sessions) <= mix.cancelled

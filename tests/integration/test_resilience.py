"""Faults mid-stream on a real stack: Redis killed or frozen, a cancelled turn, a dead orchestrator.

Redis here is the test's own redis-server on a free port (started, killed,
SIGSTOPped and restarted by pid): the machine's shared Redis is never touched.
Every stream is greedy on the tiny models and compared with the fault-free
text; each fault is repeated 5 times. Sampled streams (the default proposer,
the gate, the server's k, the coupled sampler of a seeded request) resumed
after their orchestrator is killed under load are compared with target-only
decoding of the same seed: the delivered prefix and its continuation.
SPECDEC_RESUME_RUNS sets how many kills that test makes (default 2, 8 streams each).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from client import Client
from specdec.runtime import procs
from specdec.runtime.store import SessionStore, connect
from tests.integration.stack import Stack

PROMPT = "The cat sat on the mat and the dog sat on the"
MAX_NEW = 120
OPTIONS = dict(max_new_tokens=MAX_NEW, proposer="draft", k=3)
RUNS = 5
RESUME_RUNS = int(os.environ.get("SPECDEC_RESUME_RUNS", "2"))
SAMPLED = dict(max_new_tokens=64, temperature=0.8, top_p=0.95)
SAMPLED_PROMPTS = ["The cat sat on the", "A quick brown fox", "def add(a, b):", "The capital of France",
                   "Please rewrite the following", "Speculative decoding drafts", "the dog sat on the log",
                   "return a + b"]


class RedisServer:
    """A private redis-server on a free port (no persistence), controlled by pid."""

    def __init__(self, logs: Path) -> None:
        self.port = procs.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.logs = logs
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.logs / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self.ping():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def ping(self) -> bool:
        async def go() -> bool:
            client = connect(self.url, timeout_s=0.2)
            try:
                return bool(await client.ping())
            except Exception:  # noqa: BLE001 - not up yet
                return False
            finally:
                await client.aclose()
        return asyncio.run(go())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()
            self.kill()


def later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def env(tiny_pair, tmp_path_factory):
    """Private Redis; target + draft registered there; orchestrators A and B (bound 5 s, the
    default) and C (bound 1 s)."""
    target_dir, draft_dir = tiny_pair
    logs = tmp_path_factory.mktemp("resilience")
    redis = RedisServer(logs)
    s = Stack(logs=logs, redis_url=redis.url)
    try:
        s.start_service("target", "target", target_dir)
        s.start_service("draft", "draft", draft_dir)
        for name in ("orchA", "orchB"):
            s.start_orchestrator(name, target_dir)
        s.start_orchestrator("orchC", target_dir, extra=("--redis-outage-s", "1"))
        with Client(s.addresses["orchA"], timeout=120) as c:
            reference = c.complete(PROMPT, **OPTIONS)
        assert reference.stats.new_tokens == MAX_NEW  # long enough to span the faults
        yield s, redis, reference, tiny_pair
    finally:
        s.processes.stop_all()
        redis.stop()


def _wait_registered(redis: RedisServer, stack: Stack) -> None:
    """After a Redis restart (it keeps nothing): until both services have beaten again."""
    async def count() -> int:
        client = connect(redis.url)
        try:
            return len([k async for k in client.scan_iter(match=f"{stack.prefix}service:*")])
        finally:
            await client.aclose()
    deadline = time.monotonic() + 15
    while asyncio.run(count()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _stream_with_redis_fault(address: str, fault, *, after_chunks: int = 2, **options):
    """(text, chunks) of one kept-session stream with `fault()` run after `after_chunks` chunks."""
    with Client(address, timeout=120, retries=0) as c:
        stream = c.generate(PROMPT, keep_session=True, **OPTIONS, **options)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == after_chunks:
                fault()
        return "".join(ch.text for ch in chunks), chunks, stream.stats


@pytest.mark.parametrize("down_s", [1.0, 5.0])
def test_redis_killed_mid_stream_within_the_bound(env, down_s):
    stack, redis, reference, _ = env
    ok = 0
    for _ in range(RUNS):
        def fault():
            redis.kill()
            later(down_s, redis.start)
        started = time.monotonic()
        text, _, stats = _stream_with_redis_fault(stack.addresses["orchA"], fault)
        elapsed = time.monotonic() - started
        ok += text == reference.text
        assert elapsed >= down_s * 0.9  # the kept session's last state waited for Redis
        _wait_registered(redis, stack)
        record = _record(redis, stack, stats.session_id)  # written again once Redis came back
        assert record is not None and record.multi_turn
    print(f"\nredis down {down_s:g} s mid-stream: {ok}/{RUNS} identical")
    assert ok == RUNS


def test_redis_frozen_mid_stream(env):
    stack, redis, reference, _ = env
    ok = 0
    for _ in range(RUNS):
        def fault():
            redis.freeze()
            later(1.0, redis.thaw)
        text, _, stats = _stream_with_redis_fault(stack.addresses["orchA"], fault)
        ok += text == reference.text
        assert _record(redis, stack, stats.session_id) is not None
    print(f"\nredis frozen 1 s mid-stream: {ok}/{RUNS} identical")
    assert ok == RUNS


def test_past_the_bound_unavailable_then_the_prefix_lands(env):
    stack, redis, reference, _ = env
    received: list = []
    with Client(stack.addresses["orchC"], timeout=120, retries=0) as c:
        stream = c.generate(PROMPT, keep_session=True, **OPTIONS)
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stream:
                received.append(chunk)
                if len(received) == 2:
                    redis.kill()
        sid = stream.session_id
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "redis" in info.value.details() and "redis://" not in info.value.details()
    redis.start()
    tokens = [t for ch in received for t in ch.token_ids]
    deadline = time.monotonic() + 10
    while (record := _record(redis, stack, sid)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert record is not None, "the committed prefix was not saved when Redis came back"
    start = received[0].start_index
    assert list(record.tokens[start : start + len(tokens)]) == tokens
    assert "".join(ch.text for ch in received) == reference.text[: len("".join(ch.text for ch in received))]
    _wait_registered(redis, stack)


def test_cancelled_turn_then_retry(env):
    stack, redis, _, _ = env
    turn1 = [{"role": "user", "content": "Tell me about the cat."}]
    ok = 0
    with Client(stack.addresses["orchB"], timeout=120) as c:
        for _ in range(RUNS):
            first = c.complete(messages=turn1, max_new_tokens=10, proposer="draft", k=3, keep_session=True)
            sid = first.stats.session_id
            turn2 = turn1 + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "And the dog?"}]
            expected = c.complete(messages=turn2, max_new_tokens=60, proposer="none")
            stream = c.generate(messages=turn2, max_new_tokens=60, proposer="draft", k=3, session_id=sid)
            for i, _chunk in enumerate(stream):
                if i == 2:
                    stream.cancel()
                    break
            time.sleep(0.2)
            assert _record(redis, stack, sid) is not None  # the session survived the cancellation
            retry = c.complete(messages=turn2, max_new_tokens=60, proposer="draft", k=3, session_id=sid)
            ok += retry.text == expected.text and retry.token_ids == expected.token_ids
            assert retry.stats.session_id == sid and retry.stats.reused_prompt_tokens > 0
            assert c.end_session(sid)
    print(f"\nclient cancels turn 2, retries: {ok}/{RUNS} identical")
    assert ok == RUNS


def test_orchestrator_sigkill_mid_stream_resumes_on_the_other(env):
    stack, _, reference, (target_dir, _) = env
    ok = 0
    for run in range(RUNS):
        serving, other = ("orchA", "orchB") if run % 2 == 0 else ("orchB", "orchA")
        with Client([stack.addresses[serving], stack.addresses[other]], timeout=120) as c:
            stream = c.generate(PROMPT, **OPTIONS)
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:
                    stack.procs[serving].kill()  # SIGKILL: no goodbye to the client or Redis
            assert c.address == stack.addresses[other]
        text = "".join(ch.text for ch in chunks)
        ids = [t for ch in chunks for t in ch.token_ids]
        index = chunks[0].start_index
        for ch in chunks:  # contiguous: no duplicates, no gaps
            assert ch.start_index == index
            index += len(ch.token_ids)
        ok += text == reference.text and tuple(ids) == reference.token_ids
        stack.processes.running.pop(serving).wait()
        stack.addresses[serving] = stack.start_orchestrator(serving, target_dir)
    print(f"\norchestrator SIGKILL mid-stream, second one up: {ok}/{RUNS} identical")
    assert ok == RUNS


def _sampled_stream(addresses: list[str], prompt: str, seed: int, out: dict, started: threading.Event) -> None:
    """One seeded sampled stream in the default configuration, failing over between addresses."""
    try:
        with Client(addresses, timeout=120) as c:
            stream = c.generate(prompt, seed=seed, **SAMPLED)
            for chunk in stream:
                out.setdefault("chunks", []).append(chunk)
                started.set()
            out["stats"] = stream.stats
    except grpc.RpcError as exc:
        out["error"] = f"{exc.code().name}: {exc.details()}"
    finally:
        started.set()


def test_sampled_streams_resume_after_an_orchestrator_dies_under_load(env):
    """8 seeded sampled streams at once; the orchestrator serving them is killed once each has a
    chunk; every stream resumes on the other and ends with the target-only text of its seed."""
    stack, _, _, (target_dir, _) = env
    with Client(stack.addresses["orchA"], timeout=120) as c:
        reference = {(p, s): c.complete(p, seed=s, proposer="none", **SAMPLED).token_ids
                     for s in range(1, RESUME_RUNS + 1) for p in SAMPLED_PROMPTS}
    ok = resumed = 0
    for run in range(1, RESUME_RUNS + 1):
        serving, other = ("orchA", "orchB") if run % 2 else ("orchB", "orchA")
        addresses = [stack.addresses[serving], stack.addresses[other]]
        outs = [dict() for _ in SAMPLED_PROMPTS]
        started = [threading.Event() for _ in SAMPLED_PROMPTS]
        threads = [threading.Thread(target=_sampled_stream, args=(addresses, p, run, out, ev), daemon=True)
                   for p, out, ev in zip(SAMPLED_PROMPTS, outs, started)]
        for t in threads:
            t.start()
        for ev in started:
            ev.wait(60)
        in_flight = sum("stats" not in out for out in outs)
        stack.procs[serving].kill()  # SIGKILL mid-stream: no goodbye to the clients or Redis
        for t in threads:
            t.join(180)
        for prompt, out in zip(SAMPLED_PROMPTS, outs):
            assert "error" not in out, out["error"]
            chunks = out["chunks"]
            index = chunks[0].start_index
            for ch in chunks:  # contiguous: no duplicates, no gaps
                assert ch.start_index == index
                index += len(ch.token_ids)
            ids = tuple(t for ch in chunks for t in ch.token_ids)
            ok += ids == reference[(prompt, run)]
        resumed += in_flight
        stack.processes.running.pop(serving).wait()
        stack.addresses[serving] = stack.start_orchestrator(serving, target_dir)
    print(f"\nsampled streams through an orchestrator SIGKILL: {ok}/{len(SAMPLED_PROMPTS) * RESUME_RUNS} "
          f"equal target-only for their seed ({resumed} were mid-stream at the kill)")
    assert resumed >= RESUME_RUNS  # the kill did break streams
    assert ok == len(SAMPLED_PROMPTS) * RESUME_RUNS


def test_single_turn_requests_leave_no_keys(env):
    stack, redis, _, _ = env

    async def keys():
        client = connect(redis.url)
        try:
            found = {k.decode(): await client.pttl(k) async for k in client.scan_iter(match=f"{stack.prefix}*")}
        finally:
            await client.aclose()
        return found

    before = asyncio.run(keys())  # kept sessions of the tests above
    with Client(stack.addresses["orchA"], timeout=120) as c:
        for i in range(6):
            c.complete(f"{PROMPT} {i}", max_new_tokens=8, proposer="draft" if i % 2 else "lookup")
        kept = c.complete(PROMPT, max_new_tokens=4, keep_session=True)
    found = asyncio.run(keys())
    sessions = [k for k in found if ":session:" in k and k not in before]
    assert sessions == [f"{stack.prefix}session:{kept.stats.session_id}"]  # only the kept one
    indexes = {k: ttl for k, ttl in found.items() if ":services:" in k}
    assert indexes and all(0 < ttl <= 6000 for ttl in indexes.values()), indexes
    print(f"\nsingle-turn requests: 0 session keys left; index TTLs {sorted(indexes.values())} ms")


def _record(redis: RedisServer, stack: Stack, session_id: str):
    async def go():
        client = connect(redis.url)
        try:
            return await SessionStore(client, prefix=stack.prefix).load(session_id)
        except Exception:  # noqa: BLE001 - Redis still down
            return None
        finally:
            await client.aclose()
    return asyncio.run(go())

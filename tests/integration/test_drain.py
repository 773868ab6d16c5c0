"""Graceful drain on SIGTERM: in-flight streams move to another replica with identical text.

SPECDEC_FAULT_RUNS (default 2; 5 for the README's table) sets how many SIGTERMs each fault test makes.
"""
from __future__ import annotations

import os
import threading
import time
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from specdec.core.fingerprint import EMPTY
from specdec.v1 import model_pb2, model_pb2_grpc
from tests.integration.faults import PROMPTS, sigterm, streams_with_fault
from tests.integration.stack import Stack

RUNS = int(os.environ.get("SPECDEC_FAULT_RUNS", "2"))
STREAMS = 5
OPTIONS = dict(max_new_tokens=160, proposer="draft", k=3)


@pytest.fixture(scope="module")
def drain_stack(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("drain"))
    try:
        for i in (1, 2):
            s.start_service(f"target{i}", "target", target_dir)
            s.start_service(f"draft{i}", "draft", draft_dir)
        s.target_dir, s.draft_dir = target_dir, draft_dir
        s.start_orchestrator("orch", target_dir)
        with Client(s.addresses["orch"], timeout=120) as c:
            s.expected = {p: c.complete(p, **{**OPTIONS, "proposer": "none"}).token_ids
                          for p in PROMPTS[:STREAMS]}
        yield s
    finally:
        s.stop()


def _registered(stack: Stack, role: str, name: str) -> bool:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return bool(client.exists(f"{stack.prefix}service:{role}:{name}"))
    finally:
        client.close()


def _sigterm_mid_stream(stack: Stack, role: str, name: str) -> tuple[int, int, list]:
    """SIGTERM `name` while STREAMS streams run; (identical, total, runs), then restart it."""
    proc = stack.procs[name]
    runs = streams_with_fault(stack.addresses["orch"], PROMPTS[:STREAMS], lambda: sigterm(proc.pid),
                              **OPTIONS)
    assert proc.wait(timeout=30) == 0  # drained and exited cleanly
    stack.processes.running.pop(name)
    stack.start_service(name, role, stack.target_dir if role == "target" else stack.draft_dir)
    ok = sum(r.finished and tuple(r.tokens) == stack.expected[r.prompt] for r in runs)
    return ok, len(runs), runs


def test_target_sigterm_moves_in_flight_streams_with_identical_text(drain_stack):
    ok = total = 0
    for i in range(RUNS):
        name = f"target{1 + i % 2}"
        gone = drain_stack.addresses[name]
        k, n, runs = _sigterm_mid_stream(drain_stack, "target", name)
        ok, total = ok + k, total + n
        for r in runs:
            assert r.error is None, f"{r.prompt!r}: {r.error.code().name}: {r.error.details()}"
            assert r.stats.target_replica != gone  # every session left the draining replica
    print(f"target SIGTERM: {ok}/{total} streams identical over {RUNS} runs")
    assert ok == total


def test_draft_sigterm_moves_or_falls_back_with_identical_text(drain_stack):
    ok = total = 0
    for i in range(RUNS):
        name = f"draft{1 + i % 2}"
        gone = drain_stack.addresses[name]
        k, n, runs = _sigterm_mid_stream(drain_stack, "draft", name)
        ok, total = ok + k, total + n
        for r in runs:
            assert r.error is None, f"{r.prompt!r}: {r.error.code().name}: {r.error.details()}"
            assert r.stats.draft_replica != gone or r.stats.proposer == "none"
    print(f"draft SIGTERM: {ok}/{total} streams identical over {RUNS} runs")
    assert ok == total


def test_a_draining_replica_is_not_serving_unregistered_and_refuses_new_sessions(drain_stack):
    """While a target drains: health NOT_SERVING, no registry entry, new sessions refused with
    "draining", and an orchestrator that still routes new sessions there moves them."""
    stack = drain_stack
    other = "target2"
    # An orchestrator that knows both targets only statically (its registry namespace is
    # empty), so new sessions keep being routed to the draining one.
    orch = stack.start_orchestrator(
        "orch-static", stack.target_dir,
        targets=[stack.addresses["target1"], stack.addresses[other]],
        extra=("--redis-prefix", f"{stack.prefix}static:"))
    address = stack.addresses["target1"]
    proc = stack.procs["target1"]
    assert _registered(stack, "target", "target1")
    refused: list[str] = []
    stop, answered = threading.Event(), threading.Event()

    def keep_calling() -> None:
        """New sessions, every 50 ms: keeps the drain open (it ends after 0.5 s without calls)."""
        with grpc.insecure_channel(address) as channel:
            stub = model_pb2_grpc.TargetServiceStub(channel)
            while not stop.is_set():
                try:
                    stub.Score(model_pb2.ScoreRequest(session_id=uuid.uuid4().hex, prefix_hash=EMPTY,
                                                      tokens=[1, 2, 3]), timeout=5)
                    answered.set()
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (exc.details() or ""):
                        refused.append(exc.details())
                time.sleep(0.05)

    caller = threading.Thread(target=keep_calling, daemon=True)
    caller.start()
    try:
        assert answered.wait(30), "the caller's calls were not answered"  # calls are coming: drain now
        sigterm(proc.pid)
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused, "no call was refused as draining"
        assert not _registered(stack, "target", "target1")  # left the registry at once
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with Client(orch, timeout=120) as c:
            for prompt in PROMPTS[:4]:  # round-robin: about half are first routed to target1
                out = c.complete(prompt, **OPTIONS)
                assert out.token_ids == stack.expected[prompt]
                assert out.stats.target_replica == stack.addresses[other]
        assert proc.poll() is None  # still draining while calls keep coming
    finally:
        stop.set()
        caller.join(10)
        stack.stop_one("orch-static")
    assert proc.wait(timeout=15) == 0  # exits once the calls stop
    stack.processes.running.pop("target1")
    stack.start_service("target1", "target", stack.target_dir)

"""Gray failures and overload on a real stack: frozen and CPU-starved replicas, shed streams.

Two tiny targets and one tiny draft registered in Redis under a private
prefix, an orchestrator discovering them (ejections probed every 0.5 s), and
for the last tests an orchestrator with one static target and one with a
small fixed capacity behind the HTTP gateway. Faults are SIGSTOP/SIGCONT by
pid (a process that is alive but answers nothing) and a SIGSTOP/SIGCONT duty
cycle (the process runs 20 ms out of every 100: five times slower). Every
stream is greedy and compared with the fault-free target-only text.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from client import Client
from specdec.runtime import procs
from tests.integration.faults import PROMPTS, Throttle, freeze, stream_in_thread, streams_with_fault
from tests.integration.stack import ENV, Stack
from tests.integration.stack import wait_http
from tests.integration.test_gateway import scrape

MAX_NEW = 120
OPTIONS = dict(max_new_tokens=MAX_NEW, proposer="draft", k=3)
FREEZE_S = 6.0


@pytest.fixture(scope="module")
def gray(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("gray-logs"))
    try:
        stack.start_service("target1", "target", target_dir, wait=False)
        stack.start_service("target2", "target", target_dir, wait=False)
        stack.start_service("draft", "draft", draft_dir, wait=False)
        stack.wait_serving("target1", "target2", "draft")
        stack.metrics_port = procs.free_port()
        # A fixed admission capacity: these tests are about ejection and deadlines; the measured
        # capacity once read a healthy replica's queue, on a loaded machine, as saturation and shed
        # a lone stream (RESOURCE_EXHAUSTED target_capacity): admission is tests/unit/test_gray.py's
        # subject, and the last test's here (its own orchestrator).
        stack.start_orchestrator("orch", target_dir, extra=(
            "--metrics-port", str(stack.metrics_port), "--eject-s", "0.5", "--max-eject-s", "1",
            "--target-capacity", "8"))
        with Client(stack.addresses["orch"], timeout=120) as c:
            stack.expected = {p: c.complete(p, max_new_tokens=MAX_NEW, proposer="none").token_ids
                              for p in PROMPTS[:4]}
            for p in PROMPTS[:4]:  # the draft's and both targets' usual latencies are learned
                c.complete(p, **OPTIONS)
        yield stack
    finally:
        stack.stop()


def _ejected(stack: Stack, role: str, name: str) -> float:
    key = f'specdec_replica_ejected{{address="{stack.addresses[name]}",role="{role}"}}'
    return scrape(stack.metrics_port).get(key, 0.0)


def _wait_for(predicate, timeout_s: float, step_s: float = 0.1) -> float:
    """Seconds until predicate() holds; fails after timeout_s."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(step_s)
    return time.monotonic() - started


def _streams_while_frozen(gray, name: str, prompts) -> list:
    """Streams with `name` frozen for FREEZE_S once they are under way: each has its fault-free
    text, and all end while it is still frozen (a deadline each, not the freeze)."""
    pid = gray.procs[name].pid
    started = time.monotonic()
    runs = streams_with_fault(gray.addresses["orch"], prompts, lambda: freeze(pid, FREEZE_S),
                              after_tokens=8, **OPTIONS)
    elapsed = time.monotonic() - started
    for run in runs:
        assert run.error is None and run.tokens == list(gray.expected[run.prompt])
    assert elapsed < FREEZE_S - 1.0
    assert sum(r.stats.deadline_misses for r in runs) >= 1
    return runs


def test_a_frozen_draft_costs_its_streams_a_deadline_not_the_freeze(gray):
    runs = _streams_while_frozen(gray, "draft", PROMPTS[:3])
    for run in runs:
        assert run.stats.proposer == "draft" and not run.stats.fallback_reason  # rounds, not the request
    assert _ejected(gray, "draft", "draft") == 1.0
    # Resumed: its probe answers, it is back in rotation and the next stream drafts on it.
    _wait_for(lambda: _ejected(gray, "draft", "draft") == 0.0, FREEZE_S + 10)
    with Client(gray.addresses["orch"], timeout=60) as c:
        again = c.complete(PROMPTS[0], **OPTIONS)
    assert again.token_ids == gray.expected[PROMPTS[0]]
    assert again.stats.draft_calls > 0 and again.stats.deadline_misses == 0


def test_a_frozen_target_moves_its_streams_to_the_other_with_identical_text(gray):
    runs = _streams_while_frozen(gray, "target1", PROMPTS[:4])  # some were on target1
    for run in runs:
        assert run.stats.target_replica == gray.addresses["target2"]
    _wait_for(lambda: _ejected(gray, "target", "target1") == 0.0, FREEZE_S + 10)


def test_a_replica_slowed_5x_is_ejected_on_its_slow_answers_and_gets_no_new_sessions(gray):
    # Counted in sessions, not seconds: a loaded machine slows every call, not the verdict. Sessions
    # are spread over the targets and each is 24 one-token Scores. Stopped 80 ms of every 100,
    # target2 answers fast while it runs and stalls between: on a fast machine most answers are
    # fast, so the median never ejects it, and its 20 answers' total time does (outliers'
    # BURST_SAMPLES), within its first session; 8 sessions give it several.
    slow = gray.addresses["target2"]
    placed: list[tuple[int, str]] = []
    ejected_after = None
    with Client(gray.addresses["orch"], timeout=60) as c, Throttle(gray.procs["target2"].pid):
        while len(placed) < (8 if ejected_after is None else ejected_after + 4):
            done = c.complete(PROMPTS[len(placed) % 4], max_new_tokens=24, proposer="none")
            assert done.token_ids == gray.expected[PROMPTS[len(placed) % 4]][:24]
            placed.append((len(placed), done.stats.target_replica))
            if ejected_after is None and _ejected(gray, "target", "target2") == 1.0:
                ejected_after = len(placed)
    assert ejected_after is not None, placed
    after = [replica for n, replica in placed if n >= ejected_after]
    assert len(after) == 4 and slow not in after, placed  # no new session went to it once ejected
    # Running freely again: its probes are no slower than target1's, and it is readmitted.
    _wait_for(lambda: _ejected(gray, "target", "target2") == 0.0, 15.0)


def test_with_no_other_target_a_frozen_one_is_waited_on_up_to_the_bound_then_unavailable(gray, tiny_pair):
    target_dir, _ = tiny_pair
    solo = gray.start_orchestrator("solo", target_dir, targets=[gray.addresses["target1"]], extra=(
        "--redis-prefix", f"{gray.prefix}solo:", "--target-wait-s", "2"))  # no registry: static
    pid = gray.procs["target1"].pid
    with Client(solo, timeout=60, retries=0) as c:  # no resume: see the orchestrator's own status
        assert c.complete(PROMPTS[0], **OPTIONS).token_ids == gray.expected[PROMPTS[0]]
        # Frozen for less than the bound: the stream waits on its call, same text.
        short = streams_with_fault(solo, PROMPTS[:1], lambda: freeze(pid, 1.0), after_tokens=8, **OPTIONS)
        assert short[0].error is None and short[0].tokens == list(gray.expected[PROMPTS[0]])
        # Frozen past it: UNAVAILABLE at the bound, not at the end of the freeze.
        timer = freeze(pid, FREEZE_S)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            c.complete(PROMPTS[1], **OPTIONS)
        failed_s = time.monotonic() - started
        timer.join()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 1.5 < failed_s < 4.5
    gray.stop_one("solo")


def test_past_capacity_streams_are_refused_at_once_and_the_gateway_says_429_retry_after(gray, tiny_pair):
    target_dir, _ = tiny_pair
    small = gray.start_orchestrator("small", target_dir, extra=(
        "--target-capacity", "1", "--admission-wait-s", "0.1"))  # 2 targets: 2 streams at once
    started = [stream_in_thread(small, PROMPTS[i % 4], **OPTIONS) for i in range(8)]
    for _, thread in started:
        thread.join(120)
    runs = [r for r, _ in started]
    ok = [r for r in runs if r.error is None]
    refused = [r for r in runs if r.error is not None]
    assert len(ok) >= 2 and refused
    for run in ok:
        assert run.tokens == list(gray.expected[run.prompt])
    for run in refused:
        assert run.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert run.error.details().startswith("target_capacity:")
        assert dict(run.error.trailing_metadata()).get("retry-after", "").isdigit()

    port = procs.free_port()
    gateway = procs.start(["python", "-m", "gateway", "--orchestrator", small, "--port", str(port)],
                          env=ENV, log_path=gray.logs / "gateway.log")
    gray.procs["gateway"] = gateway
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/v1/models", gateway)
    # Fill every target replica the orchestrator admits to (2, or 1 while an earlier test's
    # ejected replica waits for its probe): a holder that finds no room is refused like any other.
    holders = [stream_in_thread(small, PROMPTS[i], max_new_tokens=400, proposer="none") for i in range(2)]
    _wait_for(lambda: all(len(r.tokens) >= 4 or r.done.is_set() for r, _ in holders), 30)
    running = [(r, t) for r, t in holders if not r.done.is_set()]
    assert running, [(len(r.tokens), r.error) for r, _ in holders]
    for run, _ in holders:
        if run.done.is_set():
            assert run.error is not None and run.error.details().startswith("target_capacity:"), run.error
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(
        {"model": "specdec", "prompt": "The cat", "max_tokens": 8, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    began = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    answered_s = time.monotonic() - began
    for run, thread in running:
        thread.join(120)
        assert run.error is None
    assert http.value.code == 429 and int(http.value.headers["Retry-After"]) >= 1
    assert json.loads(http.value.read())["error"]["message"].startswith("target_capacity:")
    assert answered_s < 1.5
    gray.stop_one("gateway")
    gray.stop_one("small")

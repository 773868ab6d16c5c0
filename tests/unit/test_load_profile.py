"""benchmarks.load.profile: py-spy's collapsed stacks summed by part, and the sampler itself."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.load import profile

LOOP = "Runner.run (asyncio/runners.py:118);BaseEventLoop._run_once (asyncio/base_events.py:1922);Handle._run (asyncio/events.py:80)"
SAMPLES = "\n".join([
    # a Redis write made from the round's commit: Redis, not the round
    f"{LOOP};commit (orchestrator/round/steps.py:170);SessionStore._write_saves (specdec/runtime/store.py:88);"
    "Pipeline.execute (redis/asyncio/client.py:1500) 6",
    # the Score batch's write on the stream: the orchestrator's gRPC calls
    f"{LOOP};CallBatcher._run (orchestrator/fleet/batching.py:149);BatchStream.send (orchestrator/fleet/streams.py:91);"
    "_StreamRequestMixin._write (grpc/aio/_call.py:500) 4",
    f"{LOOP};verify (orchestrator/round/steps.py:140);verify_greedy (specdec/core/verify.py:30) 3",
    f"{LOOP} 5",  # gRPC's Cython work, no Python frame above the callback
    "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982) 2",  # the poller thread
    f"{LOOP};observe (orchestrator/api/metrics.py:40);Histogram.observe (prometheus_client/metrics.py:600) 1",
    "BaseEventLoop._run_once (asyncio/base_events.py:1900);EpollSelector.select (selectors.py:468) 100",  # idle
    "not a sample line",
])


def test_each_sample_counts_in_the_part_of_its_innermost_named_frame() -> None:
    shares = profile.parts(SAMPLES)
    assert shares["samples"] == 21  # the idle epoll samples are not CPU
    expected = {"redis": 6, "grpc calls": 4, "round": 3, "grpc C": 5, "threads in C": 2, "metrics": 1}
    for part, count in expected.items():
        assert shares[part] == pytest.approx(count / 21), part
    assert shares["fleet"] == shares["request"] == shares["other"] == 0
    # Control: the outermost frame's part instead would put the Redis write under the round.
    assert profile.part_of(["commit (orchestrator/round/steps.py:1)"]) == "round"


def test_top_functions_are_self_time_without_the_idle_loop() -> None:
    top = dict(profile.top_functions(SAMPLES, n=3))
    assert top == {"Pipeline.execute (redis/asyncio/client.py)": pytest.approx(6 / 21),
                   "Handle._run (asyncio/events.py)": pytest.approx(5 / 21),
                   "_StreamRequestMixin._write (grpc/aio/_call.py)": pytest.approx(4 / 21)}


def test_the_sampler_records_a_running_python_process(tmp_path) -> None:
    if profile.Sampler.available() is None:
        pytest.skip("py-spy is not installed (the bench extra)")
    busy = subprocess.Popen([sys.executable, "-c",
                             "def spin():\n    while True: sum(range(1000))\nspin()"])
    try:
        time.sleep(0.5)
        sampler = profile.Sampler(rate=200)
        sampler.start(busy.pid, tmp_path / "busy.txt")
        time.sleep(1.5)
        written = sampler.stop()
    finally:
        busy.kill()
        busy.wait()
    if not written and any("ermission" in e or "ptrace" in e for e in sampler.errors):
        pytest.skip(f"py-spy may not read another process here: {sampler.errors}")
    assert written, sampler.errors
    text = profile.merged(written)
    assert "spin (<string>" in text
    assert profile.parts(text)["samples"] >= 50

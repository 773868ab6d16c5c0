"""No orphans: the children of `specdec up` die with it, even when it is SIGKILLed."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import redis

from specdec.runtime import procs
from specdec.runtime.store import HEARTBEAT_S
from tests.integration.faults import alive, children_of
from tests.integration.stack import REDIS_URL

REGISTRY_TTL_S = 3 * HEARTBEAT_S  # store.ServiceRegistry's default


def _wait(predicate, timeout: float, step: float = 0.1) -> float:
    """Seconds until `predicate()` held; raises TimeoutError after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError
        time.sleep(step)
    return time.monotonic() - start


def test_children_of_specdec_up_die_with_it_on_sigkill(tiny_pair, tmp_path):
    target_dir, draft_dir = tiny_pair
    out = tmp_path / "up.out"
    up = procs.start([
        "python", "-m", "launcher.cli", "up", "--target-model", str(target_dir),
        "--draft-model", str(draft_dir), "--port", str(procs.free_port()), "--threads", "1",
        "--redis-url", REDIS_URL, "--default-k", "3", "--logs", str(tmp_path / "logs"),
        "--gateway-port", str(procs.free_port()),
    ], env={"OMP_NUM_THREADS": "1"}, log_path=out)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        _wait(lambda: "ready:" in out.read_text() or up.poll() is not None, 240, 0.2)
        assert up.poll() is None, out.read_text()
        prefix = re.search(r"key prefix (\S+)\)", out.read_text()).group(1)
        children = children_of(up.pid)
        assert len(children) == 4  # target, draft, orchestrator, gateway (this Redis is not its own)
        assert "playground    http://127.0.0.1:" in out.read_text()
        assert client.keys(f"{prefix}service:*")  # both services registered

        os.kill(up.pid, signal.SIGKILL)
        up.wait()
        # Each child drains on its SIGTERM for at most its --grace (10 s), then exits.
        gone_s = _wait(lambda: not any(alive(p) for p in children), 20)
        keys_s = _wait(lambda: not client.keys(f"{prefix}service:*"), REGISTRY_TTL_S + 2)
        print(f"specdec up SIGKILLed: 0/{len(children)} children alive after {gone_s:.1f} s, "
              f"registry entries gone after {keys_s:.1f} s")
    finally:
        for pid in children_of(up.pid) if up.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
        procs.stop(up)
        client.close()


def test_a_child_started_from_another_thread_outlives_that_thread_and_dies_with_the_process(tmp_path):
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: from a non-main thread the child
    must not get it (it would die with the thread), and still die with the process."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import threading, time
        from specdec.runtime import procs

        def spawn():
            child = procs.start(["python", "-c",
                "from specdec.runtime.procs import watch_parent; import time; watch_parent(); time.sleep(120)"])
            open({str(pid_file)!r}, "w").write(str(child.pid))

        t = threading.Thread(target=spawn)
        t.start()
        t.join()  # the spawning thread is gone
        time.sleep(120)
    """)], start_new_session=True)
    child = 0
    try:
        _wait(lambda: pid_file.exists() and pid_file.read_text(), 60)
        child = int(pid_file.read_text())
        time.sleep(1.5)
        assert alive(child)  # outlived the thread that started it
        parent.kill()
        parent.wait()
        _wait(lambda: not alive(child), 5)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)

"""benchmarks.serving.bench.run_guidellm: a load generator that hangs is killed with every process
it forked and run again, a bounded number of times; one that fails, or hangs every time, fails."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serving.bench import run_guidellm

# Hangs (in a forked child too, as guidellm's data-loader worker does) unless MARK exists; makes it.
HANG_ONCE = """
import os, sys, time
mark, pids = sys.argv[1], sys.argv[2]
if os.path.exists(mark):
    sys.exit(0)
open(mark, "w").close()
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
open(pids, "a").write(f"{os.getpid()} {child}\\n")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split()[2] != "Z"


def test_a_hung_run_is_killed_with_its_children_and_run_again(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    argv = [sys.executable, "-c", HANG_ONCE, str(tmp_path / "mark"), str(pids)]
    started = time.monotonic()
    run_guidellm(argv, tmp_path / "log", timeout_s=2.0)
    assert time.monotonic() - started < 20
    parent, child = map(int, pids.read_text().split())
    time.sleep(0.2)
    assert not _alive(parent) and not _alive(child)  # the whole group went, the forked worker too


def test_a_run_that_hangs_every_time_fails_after_its_tries(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within 1 s in 2 tries"):
        run_guidellm(argv, tmp_path / "log", timeout_s=1.0)
    assert time.monotonic() - started < 15


def test_a_run_that_fails_is_not_run_again(tmp_path: Path) -> None:
    count = tmp_path / "count"
    argv = [sys.executable, "-c", f"open({str(count)!r}, 'a').write('x'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3"):
        run_guidellm(argv, tmp_path / "log", timeout_s=30.0)
    assert count.read_text() == "x"

"""Concurrent streams with a fault injected mid-stream, for the drain, orphan and chaos tests."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from client import Client

PROMPTS = ["The cat sat on the", "A quick brown fox", "def add(a, b):", "The capital of France",
           "Please rewrite the following", "Speculative decoding drafts", "the dog sat on the log",
           "return a + b"]


@dataclass
class StreamRun:
    """One stream's outcome: the tokens it received, then its stats or its error."""

    prompt: str
    tokens: list[int] = field(default_factory=list)
    stats: object | None = None
    error: grpc.RpcError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.stats is not None


def stream_in_thread(address: str, prompt: str, **options) -> tuple[StreamRun, threading.Thread]:
    run = StreamRun(prompt)

    def body() -> None:
        try:
            with Client(address, timeout=180) as c:
                stream = c.generate(prompt, **options)
                for chunk in stream:
                    run.tokens.extend(chunk.token_ids)
                run.stats = stream.stats
        except grpc.RpcError as exc:
            run.error = exc
        finally:
            run.done.set()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return run, thread


def streams_with_fault(address: str, prompts: Sequence[str], fault: Callable[[], None], *,
                       after_tokens: int = 8, timeout: float = 180.0, **options) -> list[StreamRun]:
    """Start one stream per prompt; once each has `after_tokens` tokens (or ended), run `fault`;
    wait for all of them to end."""
    started = [stream_in_thread(address, p, **options) for p in prompts]
    runs = [r for r, _ in started]
    deadline = time.monotonic() + timeout
    while not all(r.done.is_set() or len(r.tokens) >= after_tokens for r in runs):
        if time.monotonic() > deadline:
            raise TimeoutError("streams did not start")
        time.sleep(0.005)
    fault()
    for _, thread in started:
        thread.join(max(1.0, deadline - time.monotonic()))
    return runs


def sigterm(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def freeze(pid: int, seconds: float) -> threading.Timer:
    """SIGSTOP `pid` now and SIGCONT it after `seconds` (a gray failure: alive, answering nothing)."""
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.daemon = True
    timer.start()
    return timer


class Throttle:
    """Starve `pid` of CPU: stopped `stop_ms` out of every `run_ms + stop_ms` (5x slower by default).

    A duty cycle of SIGSTOP/SIGCONT from a thread; `stop()` (or leaving the
    `with` block) lets the process run freely again.
    """

    def __init__(self, pid: int, *, run_ms: float = 20.0, stop_ms: float = 80.0) -> None:
        self.pid, self.run_s, self.stop_s = pid, run_ms / 1e3, stop_ms / 1e3
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.run_s)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)

    def __enter__(self) -> Throttle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Start, health-check and stop specdec services as real OS processes.

Used by the tests and by the launcher. Every process gets its own process
group (so a terminal's Ctrl-C does not reach it twice) and is stopped by its
own pid, never by name.

No orphans: a child dies with the process that started it, even when that
process is SIGKILLed. Started from the main thread, the child asks the kernel
for SIGTERM on its parent's death (prctl PR_SET_PDEATHSIG, Linux) through a
tiny exec wrapper: it sets the signal, checks that its parent is still the
starter, then execs the real command in place (same pid; the setting survives
exec). Not a `preexec_fn`: Python code between fork and exec in a process with
other threads (gRPC's among them) can deadlock the child before it ever
execs. The kernel sends the signal when the *thread* that forked the child
ends, so from any other thread it is not set; instead, and always, the child
gets its parent's pid in SPECDEC_PARENT_PID, and every specdec server watches
it (`watch_parent`, started by specdec.runtime.server.serve): when the parent
is gone it SIGTERMs itself. SIGTERM is a graceful drain (deregistration at
once); a SIGKILLed service's registry entry expires with its heartbeat TTL.

A server that has shut down cleanly leaves with `exit_now`: the logs and
standard streams flushed, then os._exit, skipping the interpreter's
finalization (about a second with torch loaded, on a 2-core machine; every
stop of a service, in a rolling restart or a test, paid it).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

PARENT_ENV = "SPECDEC_PARENT_PID"
POLL_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                        ("grpc.max_reconnect_backoff_ms", 250)]
_PARENT_POLL_S = 0.5


class ServiceDied(RuntimeError):
    """The process exited before it became healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """Start `argv` in its own process group; stdout+stderr go to `log_path`.

    `env` is added to (not substituted for) this process's environment.
    A leading "python" runs this interpreter. The log path is kept on the
    returned object as `proc.log_path` for `wait_healthy`'s error message.
    """
    argv = list(argv)
    if argv and argv[0] == "python":
        argv[0] = sys.executable
    full_env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
    argv = _die_with_parent(argv)
    log_file = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            argv,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if log_path:
            log_file.close()  # the child holds its own descriptor
    proc.log_path = Path(log_path) if log_path else None  # type: ignore[attr-defined]
    return proc


# Runs as `python -c _EXEC_WITH_PDEATHSIG PARENT_PID ARGV...`: set the death
# signal, give up if the starter is already gone, then become ARGV (same pid).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _die_with_parent(argv: list[str]) -> list[str]:
    """`argv` behind the PR_SET_PDEATHSIG exec wrapper, or as is (not Linux, or not the main thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return argv
    return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv]


def watch_parent(on_gone=None, *, poll_s: float = _PARENT_POLL_S) -> threading.Thread | None:
    """In a child started by `start`: SIGTERM this process once its starting process is gone.

    The parent's pid comes from SPECDEC_PARENT_PID; without it (started some
    other way) nothing is watched. `on_gone` replaces the SIGTERM (tests).
    Returns the daemon thread polling getppid(), or None.
    """
    try:
        parent = int(os.environ.pop(PARENT_ENV, "0"))  # popped: this process's children get their own
    except ValueError:
        return None
    if parent <= 1 or (os.getppid() != parent and _alive(parent)):
        return None  # inherited from a living ancestor, not set for this process

    def gone() -> None:
        log.warning("parent process %d is gone: shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        (on_gone or gone)()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(proc: subprocess.Popen, lines: int = 40) -> str:
    path = getattr(proc, "log_path", None)
    if path is None or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def wait_healthy(
    address: str, proc: subprocess.Popen | None = None, timeout: float = 60.0, service: str = ""
) -> None:
    """Poll grpc.health.v1 at `address` until it reports SERVING.

    Fails fast (ServiceDied, with the log tail) if `proc` exits, and raises
    TimeoutError after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    last_error = "no answer"
    # gRPC's reconnect backoff (1 s, growing 1.6x per failed attempt) would leave a service that
    # took seconds to load unnoticed for seconds after it started serving: poll at our own pace.
    with grpc.insecure_channel(address, options=POLL_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise ServiceDied(
                    f"process {proc.pid} exited with {proc.returncode} before serving "
                    f"at {address}; log tail:\n{log_tail(proc)}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
            if time.monotonic() > deadline:
                tail = f"; log tail:\n{log_tail(proc)}" if proc is not None else ""
                raise TimeoutError(
                    f"{address} not SERVING after {timeout:.0f}s ({last_error}){tail}"
                )
            time.sleep(0.1)


def exit_now(code: int | None) -> NoReturn:
    """End a server process whose shutdown is done: flush the logs and stdio, then os._exit.

    Only after a clean return of the server's main (its drain, deregistration and trace
    flush done); an exception still unwinds the usual way, with its traceback."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to write to
            pass
    os._exit(code or 0)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """SIGTERM the process, wait up to `grace` seconds, then SIGKILL it; return its exit code."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode

"""Start, health-check and stop specdec services as real OS processes.

Used by the tests and by the launcher. Every process gets its own process
group (so a terminal's Ctrl-C does not reach it twice) and is stopped by its
own pid, never by name.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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
    full_env = {**os.environ, **(env or {})}
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
    with grpc.insecure_channel(address) as channel:
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

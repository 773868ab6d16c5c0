"""Ports for the servers the tests start, without the races of `procs.free_port`.

`specdec.runtime.procs.free_port` binds port 0 and closes the socket: the kernel hands out a port of
its ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), and the child process
binds it a moment later (seconds, when it imports torch first). In between nothing holds the port,
so two things can take it: another free_port call of the same test (a fixture that picks a metrics
port, then the service's own port, before either is bound), and any outgoing connection on the
machine, whose local port the kernel draws from the same range. The child then fails to bind, or,
with SO_REUSEPORT, two servers share the port and split its connections.

`free_port` here draws from below the ephemeral range, where the kernel never picks a port on its
own, hands out no port twice in one test process, and checks each one free when it hands it out. A
process starts its walk at a place drawn from its pid, so two test runs on one machine walk apart.
tests/__init__.py puts it in place of procs.free_port for the whole suite.
"""
from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

LOW = 20_000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


HIGH = max(LOW + 1_000, min(_ephemeral_start(), 32_768))  # exclusive
_lock = threading.Lock()
_given: set[int] = set()
_next = LOW + random.Random(os.getpid()).randrange(HIGH - LOW)


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port no server listens on and nothing is bound to now, never handed out before by this
    process, outside the range the kernel picks ports from (same signature as procs.free_port)."""
    global _next
    with _lock:
        for _ in range(HIGH - LOW):
            port, _next = _next, LOW + (_next + 1 - LOW) % (HIGH - LOW)
            if port not in _given and _bindable(port, host) and _bindable(port, "0.0.0.0"):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port left in {LOW}-{HIGH - 1}")

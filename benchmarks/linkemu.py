"""An emulated network link: a userspace TCP proxy that adds delay and a rate cap.

The orchestrator reaches a service through `LinkEmulator.address` instead of
the service's own port. Every chunk of bytes, in each direction, is held for
half the round-trip time after it has been serialised onto a link of the given
rate, like `tc netem delay` behind `tc tbf`. This kernel has no `sch_netem`
(probe it with `netem_available()`), so the RTT sweep uses this emulator and
the outputs say so ("emulated link (userspace proxy)").

The proxy runs in its own process (no GIL shared with the client or the
in-process peer); RTT and rate live in shared memory, so a sweep changes them
between requests without reconnecting the gRPC channels.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

_CHUNK = 256 * 1024


@dataclass(frozen=True)
class LinkSettings:
    """One direction's delay is rtt_ms / 2; rate_mbps = 0 means uncapped."""

    rtt_ms: float = 0.0
    rate_mbps: float = 0.0


def _pump(src: socket.socket, dst: socket.socket, rtt_ms, rate_mbps) -> None:
    """Copy src -> dst, releasing each chunk after serialisation + one-way delay.

    Plain threads and time.sleep, not asyncio: the event loop rounds timer
    waits up to whole milliseconds, which would add up to 1 ms per direction.
    """
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def deliver() -> None:
        try:
            while (item := pending.get()) is not None:
                due, data = item
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    sender = threading.Thread(target=deliver, daemon=True)
    sender.start()
    link_free = 0.0  # when the emulated wire finishes serialising what it holds
    try:
        while data := src.recv(_CHUNK):
            now = time.perf_counter()
            rate = rate_mbps.value
            tx = len(data) * 8 / (rate * 1e6) if rate > 0 else 0.0
            link_free = max(now, link_free) + tx
            pending.put((link_free + rtt_ms.value / 2000.0, data))
    except OSError:
        pass
    finally:
        pending.put(None)
        sender.join()


def _serve(listen_port: int, upstream: tuple[str, int], rtt_ms, rate_mbps, ready) -> None:
    server = socket.create_server(("127.0.0.1", listen_port))
    ready.set()

    def handle(client: socket.socket) -> None:
        try:
            up = socket.create_connection(upstream, timeout=10)
            up.settimeout(None)
        except OSError:
            client.close()
            return
        for sock in (client, up):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pump, args=(up, client, rtt_ms, rate_mbps), daemon=True)
        back.start()
        _pump(client, up, rtt_ms, rate_mbps)
        back.join()
        client.close()
        up.close()

    while True:
        conn, _ = server.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


class LinkEmulator:
    """A delay/rate proxy in front of one upstream address (host:port)."""

    def __init__(self, upstream: str, listen_port: int) -> None:
        host, port = upstream.rsplit(":", 1)
        ctx = mp.get_context("spawn")
        self.rtt_ms = ctx.Value("d", 0.0, lock=False)
        self.rate_mbps = ctx.Value("d", 0.0, lock=False)
        self.address = f"127.0.0.1:{listen_port}"
        ready = ctx.Event()
        self._proc = ctx.Process(
            target=_serve,
            args=(listen_port, (host, int(port)), self.rtt_ms, self.rate_mbps, ready),
            daemon=True,
            name=f"linkemu-{listen_port}",
        )
        self._proc.start()
        if not ready.wait(30):
            self.stop()
            raise RuntimeError(f"link emulator for {upstream} did not start")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def set(self, settings: LinkSettings) -> None:
        self.rtt_ms.value = float(settings.rtt_ms)
        self.rate_mbps.value = float(settings.rate_mbps)

    def stop(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()  # SIGTERM to this one pid
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)


def netem_available() -> tuple[bool, str]:
    """Can this machine run `tc qdisc ... netem` inside a network namespace?

    Creates and deletes its own namespace (`specdec-probe-<pid>`); returns
    (ok, reason). Needs root and iproute2.
    """
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) not installed"
    if os.geteuid() != 0:
        return False, "not root"
    ns = f"specdec-probe-{os.getpid()}"

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10)

    r = run("ip", "netns", "add", ns)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if r.returncode != 0:
            return False, f"ip link set lo up failed: {r.stderr.strip()}"
        r = run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                "netem", "delay", "1ms")
        if r.returncode != 0:
            return False, f"tc netem failed: {r.stderr.strip() or r.stdout.strip()}"
        return True, "ok"
    finally:
        run("ip", "netns", "del", ns)

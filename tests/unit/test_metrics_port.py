"""The metrics port (specdec.runtime.server.serve_metrics): it serves Prometheus' text, and a
connection that sends nothing is closed after the timeout instead of holding a thread for ever."""
from __future__ import annotations

import socket
import time
import urllib.request

from prometheus_client import Counter

from specdec.runtime.procs import free_port
from specdec.runtime.server import serve_metrics

PROBE = Counter("specdec_test_metrics_port_probe", "a counter this test reads back")


def test_metrics_are_served_and_a_silent_connection_is_closed() -> None:
    port = free_port()
    server = serve_metrics(port, "127.0.0.1", timeout_s=0.5)
    try:
        PROBE.inc()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "specdec_test_metrics_port_probe_total 1.0" in body
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        started = time.monotonic()
        assert silent.recv(1) == b""  # closed by the server, not by our 10 s timeout
        assert time.monotonic() - started < 5
        silent.close()
    finally:
        server.shutdown()
        server.server_close()

"""A client that drops its connection before a response that is not streamed cancels the
generation: a real gateway, orchestrator and services (tiny models); the orchestrator's target
slot and the target's forwards show the stream ended early."""
from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from specdec.runtime import procs
from tests.integration.stack import Stack

BODY = {"model": "specdec", "prompt": "The cat sat on the mat and", "max_tokens": 480,
        "temperature": 0, "ignore_eos": True, "speculation": {"proposer": "none"}}


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("specdec_"):
            key, value = line.rsplit(" ", 1)
            out[key.split("{", 1)[0]] = out.get(key.split("{", 1)[0], 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("disconnect"))
    ports = {name: procs.free_port() for name in ("target", "orch", "gateway")}
    try:
        s.start_service("target", "target", target_dir, extra=("--metrics-port", str(ports["target"])))
        s.start_service("draft", "draft", draft_dir)
        s.start_orchestrator("orch", target_dir, extra=("--metrics-port", str(ports["orch"])))
        base = s.start_gateway(extra=("--metrics-port", str(ports["gateway"])))
        yield base, ports
    finally:
        s.stop()


def _send(base: str) -> socket.socket:
    """A non-streamed completion's request on a raw connection (closed by the caller)."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps(BODY).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _streams(ports) -> float:
    return _scrape(ports["orch"]).get("specdec_target_streams", 0.0)


def _forwards(ports) -> float:
    return _scrape(ports["target"]).get("specdec_forward_seconds_count", 0.0)


def _until(check, timeout_s: float) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_client_that_disconnects_cancels_its_generation(served):
    """Counted in target forwards, not seconds (a fast machine runs the whole generation in under
    one): connected, a completion costs the target a forward per token; dropped a few tokens in,
    the stream ends long before that and the target does no more work for it."""
    base, ports = served
    # The control: connected, the whole generation (timed warm: the first one warms up).
    for _ in range(2):
        before, started = _forwards(ports), time.monotonic()
        with _send(base) as sock:
            reply = sock.makefile("rb").read()
        whole_s, whole = time.monotonic() - started, _forwards(ports) - before
    assert reply.startswith(b"HTTP/1.1 200") and whole >= BODY["max_tokens"], (reply[:200], whole)

    disconnects = _scrape(ports["gateway"]).get("specdec_http_stream_disconnects_total", 0.0)
    before = _forwards(ports)
    sock = _send(base)
    _until(lambda: _streams(ports) == 1 and _forwards(ports) - before >= 10, 10)  # generating
    sock.close()  # the client goes away without reading anything
    ended_s = _until(lambda: _streams(ports) == 0, 10)
    used = _forwards(ports) - before
    assert used < whole / 2, (used, whole)  # cancelled well before its end
    settled = _forwards(ports)
    time.sleep(0.5)
    assert _forwards(ports) == settled  # the target does no more work for it
    assert _scrape(ports["gateway"])["specdec_http_stream_disconnects_total"] == disconnects + 1
    print(f"\nnot streamed, client gone: the stream ended {ended_s:.2f} s after the disconnect, after "
          f"{used:.0f} of the whole generation's {whole:.0f} target forwards ({whole_s:.2f} s)")

"""The HTTP gateway in front of a secured orchestrator: TLS to it, the caller's bearer token passed
on, and checked from the headers before a body is read.

- no token: 401; a token the orchestrator refuses: 403; both without reading the body, so twelve
  concurrent anonymous 4 MB requests cost the gateway at most 30 MB (it grew by 1,560 MB when it
  parsed them first);
- /v1/models and the rest need a token; the probes (/health, /health/live) do not, and say
  nothing about the deployment;
- a body that stalls is a 408, headers that never finish close the connection, and connections
  past --max-concurrency are a 503 at once.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from benchmarks.faults.gateway_attack import anonymous_flood
from specdec.runtime import procs
from specdec.runtime.launch import child_env

MAX_CONCURRENCY = 24
BODY_TIMEOUT_S = 3
HEADER_TIMEOUT_S = 2


def _call(url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, _parsed(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _parsed(exc.read())


def _parsed(raw: bytes) -> dict:
    try:
        return json.loads(raw)
    except ValueError:  # uvicorn's own plain-text 503
        return {"text": raw.decode("utf-8", "replace")}


@pytest.fixture(scope="module")
def gateway(secured, tmp_path_factory):
    """(base URL, process) of a gateway in front of the secured orchestrator."""
    port = procs.free_port()
    proc = procs.start(["python", "-m", "gateway", "--orchestrator", secured.address("orch"),
                        "--port", str(port), "--tls-ca", str(secured.pki.ca),
                        "--max-concurrency", str(MAX_CONCURRENCY), "--body-timeout", str(BODY_TIMEOUT_S),
                        "--header-timeout", str(HEADER_TIMEOUT_S)],
                       env=child_env(1, quiet=True),
                       log_path=tmp_path_factory.mktemp("gateway-auth") / "gateway.log")
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, procs.log_tail(proc)
                assert time.monotonic() < deadline, "gateway not healthy"
                time.sleep(0.3)
        yield base, proc
    finally:
        procs.stop(proc)


CHAT = {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def test_gateway_passes_the_callers_token(secured, gateway) -> None:
    url = gateway[0] + "/v1/chat/completions"
    status, reply = _call(url, CHAT, None)
    assert status == 401 and reply["error"]["type"] == "authentication_error", reply
    status, reply = _call(url, CHAT, "not-a-token-of-anyone")
    assert status == 403 and reply["error"]["code"] == "invalid_api_key", reply
    status, reply = _call(url, CHAT, secured.tokens["alice"])
    assert status == 200 and reply["usage"]["completion_tokens"] == 4


def test_models_need_a_token_and_the_probes_do_not(secured, gateway) -> None:
    base = gateway[0]
    assert _call(base + "/v1/models")[0] == 401
    assert _call(base + "/v1/models", token="not-a-token-of-anyone")[0] == 403
    status, reply = _call(base + "/v1/models", token=secured.tokens["bob"])
    assert status == 200 and "specdec" in {m["id"] for m in reply["data"]}
    assert _call(base + "/tokenize", {"prompt": "hi"})[0] == 401
    assert _call(base + "/v1/responses/resp_x")[0] == 401
    for path in ("/health", "/health/live"):  # the probes: nothing about the deployment
        assert _call(base + path) == (200, {"status": "ok"})


def test_anonymous_4mb_requests_are_refused_before_their_bodies_are_read(gateway) -> None:
    base, proc = gateway
    port = int(base.rsplit(":", 1)[1])
    flood = anonymous_flood(port, proc.pid, requests=12, total=4_000_000)
    assert flood["statuses"] == [401] * 12, flood
    assert flood["rss_growth_mb"] <= 30, flood
    # The same with a token nobody holds: 403, from the headers alone.
    flood = anonymous_flood(port, proc.pid, requests=12, total=4_000_000, authorization="Bearer nobodys")
    assert flood["statuses"] == [403] * 12, flood
    assert flood["rss_growth_mb"] <= 30, flood


def _stalled(port: int, token: str) -> socket.socket:
    """A request whose headers promise 100 bytes of body that never come."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}"
                  "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
    return sock


def test_a_stalled_body_is_a_408_and_connections_past_the_limit_a_503(secured, gateway) -> None:
    base = gateway[0]
    port = int(base.rsplit(":", 1)[1])
    stalled = [_stalled(port, secured.tokens["carol"]) for _ in range(4)]
    try:
        for sock in stalled:  # each stalled body ends in a 408 once --body-timeout passes
            assert sock.recv(64).startswith(b"HTTP/1.1 408 "), "no 408 for a stalled body"
    finally:
        for sock in stalled:
            sock.close()
    # uvicorn counts every open connection, the new one too: with MAX_CONCURRENCY held, one more
    # request is refused at once (accepted in order, so the idle ones are counted before it).
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(MAX_CONCURRENCY)]
    try:
        status, reply = _call(base + "/health/live")
        assert status == 503, (status, reply)
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while _call(base + "/health/live")[0] != 200:  # the slots come back as the sockets close
        assert time.monotonic() < deadline, "connections not released"
        time.sleep(0.1)


def test_headers_that_never_finish_lose_their_connection(gateway) -> None:
    """A slow sender (one header line, then nothing) would hold a --max-concurrency place for
    ever; past --header-timeout its connection is closed."""
    port = int(gateway[0].rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
        started = time.monotonic()
        assert sock.recv(64) == b""  # closed by the gateway, well before our 30 s timeout
        assert time.monotonic() - started < 20
    finally:
        sock.close()

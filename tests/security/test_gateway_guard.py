"""The gateway is safe to expose: real gateways in front of real orchestrators, real HTTP.

- a 100 MB body is a 413 within 1 s, declared or chunked, and the gateway's memory grows by at
  most 20 MB (it never reads the body);
- /metrics is on its own port, never on the API's;
- while the orchestrator takes calls without a token, only localhost names may be in Host and
  Origin (a page on another origin, or one rebinding its name to 127.0.0.1, gets 403); once
  the orchestrator requires tokens, the API answers any Host (the token is the protection);
- the playground passes the caller's credentials on, says when it needs them, and never
  replays a run made with a token to a caller without it;
- the playground's quota is per visitor: X-Forwarded-For counts only from --trusted-proxies;
- a property-based fuzz of those headers and of body sizes around the limit: never a 5xx.
"""
from __future__ import annotations

import http.client
import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.faults.gateway_attack import huge_body
from specdec.runtime import procs
from tests.integration.stack import Stack, wait_http

CHAT = {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
LIMIT = 64 << 10  # the fuzzed gateway's --max-body-bytes


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request with exactly these headers (Host too, when given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def post(port: int, path: str, body: dict, **headers: str) -> tuple[int, dict]:
    status, raw = request(port, "POST", path, json.dumps(body).encode(),
                          {"Content-Type": "application/json", **headers})
    return status, json.loads(raw or b"null")


@pytest.fixture(scope="module")
def open_stack(tiny_pair, tmp_path_factory):
    """A token-less orchestrator with two gateways: one trusting 127.0.0.1 as a proxy, with a
    small body limit and a 3-pass quota; one trusting nobody, with /metrics on its own port."""
    target_dir, draft_dir = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("gateway-guard"))
    try:
        stack.start_service("target", "target", target_dir, register=False)
        stack.start_orchestrator("orch", target_dir, targets=[stack.addresses["target"]],
                                 extra=("--rate-per-tenant", "0"))
        metrics = procs.free_port()
        plain = stack.start_gateway("orch", ("--metrics-port", str(metrics),
                                             "--playground-passes-per-minute", "3"))
        proxied = _second_gateway(stack, ("--trusted-proxies", "127.0.0.1", "--max-body-bytes",
                                          str(LIMIT), "--playground-passes-per-minute", "3"))
        yield stack, int(plain.rsplit(":", 1)[1]), proxied, metrics
    finally:
        stack.stop()


def _second_gateway(stack: Stack, extra: tuple[str, ...]) -> int:
    from tests.integration.stack import ENV

    port = procs.free_port()
    proc = procs.start(["python", "-m", "gateway", "--orchestrator", stack.addresses["orch"],
                        "--port", str(port), *extra], env=ENV, log_path=stack.logs / "gateway2.log")
    stack.procs["gateway2"] = proc  # stopped by pid with the rest
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
    return port


# ------------------------------------------------------------------ the body limit


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100_mb_body_is_a_413_within_a_second_without_growing_the_gateway(open_stack, chunked) -> None:
    stack, port, _, _ = open_stack
    result = huge_body(port, stack.procs["gateway"].pid, 100 << 20, chunked=chunked)
    print(f"\n100 MB body ({'chunked' if chunked else 'content-length'}): {result['status']} after "
          f"{result['seconds'] * 1e3:.0f} ms, gateway peak RSS growth {result['rss_growth_mb']:.1f} MB, "
          f"{result['sent_mb']:.0f} MB sent")
    assert result["status"] == 413
    assert result["seconds"] < 1.0
    assert result["rss_growth_mb"] <= 20
    assert result["sent_mb"] < 100  # refused long before the end
    assert post(port, "/v1/chat/completions", CHAT)[0] == 200  # and it still serves


def test_the_limit_is_exact(open_stack) -> None:
    _, _, port, _ = open_stack
    at_limit = b" " * (LIMIT - 2) + b"{}"  # valid JSON of exactly the limit: parsed, then a 400
    status, raw = request(port, "POST", "/v1/chat/completions", at_limit,
                          {"Content-Type": "application/json"})
    assert status == 400, raw
    status, raw = request(port, "POST", "/v1/chat/completions", at_limit + b" ",
                          {"Content-Type": "application/json"})
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"


# ------------------------------------------------------------------ metrics


def test_metrics_are_on_their_own_port_only(open_stack) -> None:
    _, port, _, metrics = open_stack
    assert request(port, "GET", "/metrics")[0] == 404
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    assert "specdec_http_requests_total" in text


# ------------------------------------------------------------------ Host and Origin


@pytest.mark.parametrize("headers,status", [
    ({"Host": "localhost"}, 200),
    ({"Host": "127.0.0.1:8000", "Origin": "http://localhost:5173"}, 200),
    ({"Host": "[::1]:8000"}, 200),
    ({"Host": "evil.example"}, 403),  # DNS rebinding: the page's name now points at 127.0.0.1
    ({"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}, 403),
    ({"Host": "127.0.0.1", "Origin": "https://evil.example"}, 403),  # a cross-origin page
    ({"Host": "127.0.0.1", "Origin": "null"}, 403),  # a sandboxed frame or a file
], ids=lambda v: str(v))
def test_a_token_less_gateway_answers_local_names_only(open_stack, headers, status) -> None:
    _, port, _, _ = open_stack
    got, reply = post(port, "/v1/chat/completions", CHAT, **headers)
    assert got == status, reply
    if status == 403:
        assert reply["error"]["code"] == "forbidden_host"
        # The playground's API is the same gateway: refused the same way.
        assert post(port, "/playground/api/check", {"prompt": "a b", "guess": " c"}, **headers)[0] == 403
    # The probes' routes answer any Host (a pod's address, say); they hold nothing private.
    assert request(port, "GET", "/v1/models", headers={"Host": "10.1.2.3:8000"})[0] == 200


# ------------------------------------------------------------------ the playground's visitor


def _spend(port: int, passes: int, xff: str, start: int) -> list[int]:
    """`passes` one-pass Checks (each a new prompt, so none is a cached replay)."""
    return [post(port, "/playground/api/check", {"prompt": f"quota test {start + i}", "guess": " x"},
                 **{"X-Forwarded-For": xff})[0] for i in range(passes)]


def test_the_quota_trusts_forwarded_addresses_from_trusted_proxies_only(open_stack) -> None:
    _, plain, proxied, _ = open_stack
    # Behind the trusted proxy, two visitors have a quota each; a forged left-most entry
    # changes nothing (the right-most untrusted hop is the visitor).
    assert _spend(proxied, 3, "203.0.113.7", 0) == [200, 200, 200]
    assert _spend(proxied, 1, "198.51.100.1, 203.0.113.7", 10) == [429]
    assert _spend(proxied, 1, "198.51.100.1", 20) == [200]
    # A gateway that trusts no proxy: the header is the caller's claim, and all share one quota.
    assert _spend(plain, 3, "203.0.113.7", 30) == [200, 200, 200]
    assert _spend(plain, 1, "198.51.100.2", 40) == [429]


# ------------------------------------------------------------------ behind a secured orchestrator


@pytest.fixture(scope="module")
def secured_gateway(secured, tmp_path_factory):
    logs = tmp_path_factory.mktemp("secured-gateway")
    port = procs.free_port()
    proc = procs.start(["python", "-m", "gateway", "--orchestrator", secured.address("orch"),
                        "--port", str(port), "--tls-ca", str(secured.pki.ca)],
                       env={"OMP_NUM_THREADS": "1"}, log_path=logs / "gateway.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        yield port
    finally:
        procs.stop(proc)


def test_with_tokens_required_any_host_may_call_but_only_with_a_token(secured, secured_gateway) -> None:
    token = {"Authorization": f"Bearer {secured.tokens['alice']}"}
    elsewhere = {"Host": "api.example.com", "Origin": "https://app.example.com"}
    assert post(secured_gateway, "/v1/chat/completions", CHAT, **elsewhere)[0] == 401
    status, reply = post(secured_gateway, "/v1/chat/completions", CHAT, **elsewhere, **token)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_the_playground_passes_the_callers_credentials_on(secured, secured_gateway) -> None:
    status, raw = request(secured_gateway, "GET", "/playground/api/info")
    assert status == 200 and json.loads(raw)["credentials"] == "required"
    body = {"prompt": "The capital of France is", "guess": " Paris"}
    status, reply = post(secured_gateway, "/playground/api/check", body)
    assert status == 401 and "authorization" in reply["error"]["message"]
    token = {"Authorization": f"Bearer {secured.tokens['alice']}"}
    status, reply = post(secured_gateway, "/playground/api/check", body, **token)
    assert status == 200 and reply["cached"] is False
    assert post(secured_gateway, "/playground/api/check", body, **token)[1]["cached"] is True
    # The run made with a token is not replayed to a caller without one (or with another).
    assert post(secured_gateway, "/playground/api/check", body)[0] == 401
    wrong = {"Authorization": "Bearer not-a-token-of-anyone"}
    assert post(secured_gateway, "/playground/api/check", body, **wrong)[0] == 403
    status, raw = request(secured_gateway, "GET", "/playground/api/info")
    assert json.loads(raw)["credentials"] == "required"


# ------------------------------------------------------------------ fuzz of the new inputs

hosts = st.sampled_from(["localhost", "127.0.0.1:1", "[::1]", "evil.example", "", "LOCALHOST",
                         "localhost.evil.example", "127.0.0.1.nip.io", "[::1", ":::", "a" * 300])
origins = st.one_of(st.none(), st.sampled_from(["http://localhost", "null", "https://evil.example",
                                                "http://[::1]:3000", "http://127.0.0.1@evil.example",
                                                "not a url", "http://[bad"]))
forwarded = st.one_of(st.none(), st.text(alphabet="0123456789.,: abcdef[]", max_size=80))
sizes = st.one_of(st.integers(0, 64), st.integers(LIMIT - 64, LIMIT + 64), st.integers(LIMIT, 4 * LIMIT))
bodies = st.one_of(st.just(json.dumps(CHAT).encode()), st.binary(max_size=64))
paths = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/playground/api/check",
                         "/playground/api/predict", "/metrics", "/health"])


@settings(max_examples=int(__import__("os").environ.get("SPECDEC_GATEWAY_FUZZ", "150")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(host=hosts, origin=origins, xff=forwarded, size=sizes, body=bodies, path=paths,
       auth=st.sampled_from([None, "Bearer x", "Basic abc", "Bearer " + "y" * 5000]))
def test_fuzz_of_headers_and_body_sizes_finds_no_5xx(open_stack, host, origin, xff, size, body, path,
                                                     auth) -> None:
    _, _, port, _ = open_stack
    payload = (body * (size // max(1, len(body)) + 1))[:size] if body else b" " * size
    headers = {"Host": host, "Content-Type": "application/json"}
    for name, value in (("Origin", origin), ("X-Forwarded-For", xff), ("Authorization", auth)):
        if value is not None:
            headers[name] = value
    try:
        status, _ = request(port, "POST", path, payload, headers)
    except (ConnectionError, http.client.HTTPException):
        status = 0  # the server may close a connection it refused early (a 413 or a bad header)
    assert status < 500, (path, headers, size)
    if status and size > LIMIT:
        assert status in (400, 403, 404, 405, 413), (status, path, headers, size)

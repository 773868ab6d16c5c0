"""The HTTP gateway in front of a secured orchestrator: TLS to it, the caller's bearer token passed on."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from specdec.runtime import procs
from specdec.runtime.launch import child_env


def _post(url: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_gateway_passes_the_callers_token(secured, tmp_path) -> None:
    port = procs.free_port()
    proc = procs.start(["python", "-m", "gateway", "--orchestrator", secured.address("orch"),
                        "--port", str(port), "--tls-ca", str(secured.pki.ca)],
                       env=child_env(1, quiet=True), log_path=tmp_path / "gateway.log")
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
        body = {"model": "specdec", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0}
        url = base + "/v1/chat/completions"
        assert _post(url, body, None)[0] == 401
        assert _post(url, body, "not-a-token-of-anyone")[0] == 403
        status, reply = _post(url, body, secured.tokens["alice"])
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
    finally:
        procs.stop(proc)

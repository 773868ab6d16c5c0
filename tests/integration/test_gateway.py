"""The OpenAI-compatible gateway against a real stack, driven by the real `openai` package.

One module-wide stack of its own (tiny target + tiny draft + orchestrator, each with a
metrics port, real Redis) plus `python -m gateway` on a free port. The same stack serves
the dashboard check: every metric deploy/grafana/specdec.json queries must exist on it.
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.runtime import procs
from tests.integration.stack import Stack, post_json

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "specdec"
CHAT = [{"role": "user", "content": "The cat sat on the mat."}]


def scrape(port: int) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def declared_metrics(port: int) -> set[str]:
    """Every series name a /metrics page declares or has samples for.

    A labelled counter with no observation yet (e.g. evictions) is declared by its
    HELP/TYPE lines only; a histogram's queryable names are _bucket, _sum and _count.
    """
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    names = set()
    for line in body.splitlines():
        if line.startswith("# HELP "):
            names.add(line.split()[2])
        elif line.startswith("# TYPE ") and line.split()[3] == "histogram":
            base = line.split()[2]
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        elif line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


@pytest.fixture(scope="module")
def gw(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("gateway-logs"))
    metrics = {}
    try:
        for role, folder in (("target", target_dir), ("draft", draft_dir)):
            metrics[role] = procs.free_port()
            stack.start_service(role, role, folder, extra=("--metrics-port", str(metrics[role])))
        metrics["orch"] = procs.free_port()
        stack.start_orchestrator("orch", target_dir, extra=("--metrics-port", str(metrics["orch"])))
        metrics["gateway"] = procs.free_port()  # /metrics on its own port, not the API's
        base = stack.start_gateway("orch", ("--default-max-tokens", "16",
                                            "--metrics-port", str(metrics["gateway"])))
        yield SimpleNamespace(stack=stack, base=base, metrics=metrics,
                              openai=openai.OpenAI(base_url=f"{base}/v1", api_key="unused",
                                                   max_retries=0, timeout=60))
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def grpc_client(gw):
    from client import Client

    with Client(gw.stack.addresses["orch"], timeout=120) as c:
        yield c


_post = post_json


# ------------------------------------------------------------------- models, health


def test_models_and_health(gw):
    # The target's own name first (the tiny target's folder), the old id an alias.
    assert [m.id for m in gw.openai.models.list()] == ["target", MODEL]
    assert gw.openai.models.retrieve(MODEL).id == MODEL
    for path in ("/health", "/health/live"):  # open to anyone: they name no address
        with urllib.request.urlopen(f"{gw.base}{path}", timeout=5) as reply:
            assert reply.status == 200
            assert json.loads(reply.read()) == {"status": "ok"}


# ------------------------------------------------------------------- identity with gRPC


def test_chat_greedy_equals_the_grpc_path_streaming_and_not(gw, grpc_client):
    spec = {"proposer": "draft", "k": 3}
    ref = grpc_client.complete(messages=CHAT, max_new_tokens=24, temperature=0.0,
                               proposer="draft", k=3)
    whole = gw.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                              temperature=0, extra_body={"speculation": spec})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].finish_reason == {"eos": "stop"}.get(ref.stats.finish_reason,
                                                                 ref.stats.finish_reason)
    _check_usage(whole.usage, ref.stats)

    stream = gw.openai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculation": spec})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    _check_usage(chunks[-1].usage, ref.stats)
    assert len({c.id for c in chunks}) == 1


def _check_usage(u, stats) -> None:
    assert u.prompt_tokens == stats.prompt_tokens
    assert u.completion_tokens == stats.new_tokens
    assert u.total_tokens == stats.prompt_tokens + stats.new_tokens
    spec = u.model_extra["speculation"]
    # Greedy draft and greedy target: the same rounds on both paths.
    assert spec["target_passes"] == stats.target_passes
    assert spec["drafted_tokens"] == stats.drafted_tokens
    assert spec["accepted_tokens"] == stats.accepted_tokens
    assert spec["acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    assert spec["proposer"] == stats.proposer == "draft"


def test_completions_greedy_equals_the_grpc_path_with_stop(gw, grpc_client):
    prompt = "The cat sat on the mat and the dog sat on the log."
    free = grpc_client.complete(prompt, max_new_tokens=20, temperature=0.0, proposer="lookup", k=4)
    stop = free.text[len(free.text) // 2:][:2]  # a stop string from inside the greedy output
    assert stop.strip(), f"no usable stop string in {free.text!r}"
    ref = grpc_client.complete(prompt, max_new_tokens=20, temperature=0.0, proposer="lookup", k=4,
                               stop=[stop])
    assert ref.stats.finish_reason == "stop"
    spec = {"speculation": {"proposer": "lookup", "k": 4}}
    whole = gw.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                         temperature=0, stop=stop, extra_body=spec)
    assert whole.object == "text_completion"
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == ref.stats.new_tokens
    assert whole.usage.prompt_tokens == ref.stats.prompt_tokens

    pieces = list(gw.openai.completions.create(model=MODEL, prompt=[prompt], max_tokens=20,
                                               temperature=0, stop=[stop], stream=True,
                                               extra_body=spec))
    assert "".join(p.choices[0].text for p in pieces) == ref.text
    assert pieces[-1].choices[0].finish_reason == "stop"
    assert all(p.usage is None for p in pieces)  # include_usage not asked for


def test_seeded_sampling_equals_the_grpc_path(gw, grpc_client):
    ref = grpc_client.complete(messages=CHAT, max_new_tokens=16, temperature=0.9, top_p=0.95,
                               seed=1234, proposer="draft", k=2)
    got = gw.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                            temperature=0.9, top_p=0.95, seed=1234,
                                            extra_body={"speculation": {"proposer": "draft", "k": 2}})
    assert got.choices[0].message.content == ref.text
    assert got.usage.model_extra["speculation"]["seed"] == 1234


def test_defaults_and_auth_pass_through(gw):
    # No max_tokens: the gateway's --default-max-tokens (16); a bearer token is forwarded.
    authed = openai.OpenAI(base_url=f"{gw.base}/v1", api_key="sk-test-token", max_retries=0)
    got = authed.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, user="u-1")
    assert got.usage.completion_tokens <= 16
    assert got.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------- errors


def test_multi_turn_through_keep_session(gw, grpc_client):
    """A kept session's id comes back in usage; the next turn reuses its prefix.
    Without keep_session a turn is single-turn: no id, nothing to continue."""
    single = gw.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                               temperature=0)
    assert single.usage.model_extra["speculation"]["session_id"] == ""
    first = gw.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                              temperature=0, extra_body={"keep_session": True})
    session_id = first.usage.model_extra["speculation"]["session_id"]
    assert session_id
    turn2 = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And then?"}]
    second = gw.openai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6,
                                               temperature=0, extra_body={"session_id": session_id})
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    expected = grpc_client.complete(messages=turn2, max_new_tokens=6, temperature=0)
    assert second.choices[0].message.content == expected.text
    grpc_client.end_session(session_id)


def test_n_above_the_limit_is_rejected_with_the_openai_error_shape(gw):
    with pytest.raises(openai.BadRequestError) as err:
        gw.openai.chat.completions.create(model=MODEL, messages=CHAT, n=17)
    assert err.value.status_code == 400
    status, body = _post(f"{gw.base}/v1/chat/completions",
                         {"model": MODEL, "messages": CHAT, "n": 17})
    assert status == 400
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "n" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_bad_temperature_maps_the_orchestrators_invalid_argument_to_400(gw, stream):
    # In the schema's [0, 2] but below the orchestrator's smallest temperature (1e-6).
    with pytest.raises(openai.BadRequestError) as err:
        gw.openai.chat.completions.create(model=MODEL, messages=CHAT, temperature=1e-9, stream=stream)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == "temperature" and body["code"] == "invalid_argument"
    assert "temperature" in body["message"]


def test_other_errors(gw):
    status, body = _post(f"{gw.base}/v1/chat/completions",
                         {"model": "other", "messages": CHAT})
    assert (status, body["error"]["code"], body["error"]["param"]) == (404, "model_not_found", "model")
    status, body = _post(f"{gw.base}/v1/completions",
                         {"model": MODEL, "prompt": "x", "frobnicate": 1})
    assert (status, body["error"]["code"]) == (400, "unknown_parameter")
    status, body = _post(f"{gw.base}/v1/completions",
                         {"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}})
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "unsupported_parameter",
                                                                       "logit_bias")
    # Harmless neutral values pass.
    status, body = _post(f"{gw.base}/v1/completions",
                         {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0,
                          "logit_bias": {}, "frequency_penalty": 0, "user": "someone"})
    assert status == 200, body
    # The orchestrator's limits come back as 400 naming the OpenAI parameter.
    status, body = _post(f"{gw.base}/v1/completions",
                         {"model": MODEL, "prompt": "x", "max_tokens": 10**6})
    assert (status, body["error"]["param"]) == (400, "max_tokens")
    # An unknown session is the orchestrator's NOT_FOUND.
    status, body = _post(f"{gw.base}/v1/completions",
                         {"model": MODEL, "prompt": "x", "max_tokens": 2, "session_id": "nope"})
    assert (status, body["error"]["code"]) == (404, "not_found")
    # A response that is not streamed is built whole: past --max-whole-response-bytes in the worst
    # case (16 x 10,000 x 21 entries) it is refused before any work, and streaming is the way.
    huge = {"model": MODEL, "messages": CHAT, "max_tokens": 10_000, "n": 16, "logprobs": True, "top_logprobs": 20}
    status, body = _post(f"{gw.base}/v1/chat/completions", huge)
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "response_too_large", "stream")
    status, body = _post(f"{gw.base}/v1/chat/completions", {**huge, "stream": True})
    assert body is None or body.get("error", {}).get("code") != "response_too_large"


# ------------------------------------------------------------------- disconnect


def _active(gw) -> tuple[float, float]:
    return tuple(scrape(gw.metrics[r]).get("specdec_active_sessions", 0.0) for r in ("target", "draft"))


def _settled(gw) -> tuple[float, float]:
    """_active once it holds still: the streams of the tests before release their KV in the
    background after they end, and one landing during the check below would shift its counts."""
    deadline = time.monotonic() + 10
    last = _active(gw)
    while True:
        time.sleep(0.2)
        now = _active(gw)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def disconnect_mid_stream(gw, n: int = 1) -> None:
    """Break a long streamed request (n choices) off after a few chunks; every session it
    held on both services must be released."""
    before = _settled(gw)
    stream = gw.openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The cat sat"}], max_tokens=400, n=n,
        temperature=0, stream=True, extra_body={"speculation": {"proposer": "draft", "k": 2}})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3 * n:
            break
    during = _active(gw)
    assert during[0] == before[0] + n and during[1] == before[1] + n, (before, during)
    stream.close()  # the HTTP connection goes away mid-generation
    deadline = time.monotonic() + 20
    while _active(gw) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _active(gw) == before, "KV still held after the client left"


def test_disconnect_mid_stream_frees_the_kv_on_both_services(gw):
    disconnect_mid_stream(gw)


# ------------------------------------------------------------------- dashboard


def dashboard_metric_names(dashboard: dict) -> set[str]:
    """Metric names in every PromQL expression of the dashboard."""
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b(specdec_[a-z0-9_]+|vllm:[a-z0-9_]+)", expr))
    return names


def test_every_metric_the_dashboard_queries_exists_on_a_live_stack(gw, grpc_client):
    dashboard = json.loads((ROOT / "deploy/grafana/specdec.json").read_text())
    # One generation each way, so labelled series have been created.
    grpc_client.complete("The cat sat", max_new_tokens=8, temperature=0.7, seed=3,
                         proposer="draft", k=2)
    gw.openai.completions.create(model=MODEL, prompt="The cat", max_tokens=4, temperature=0)
    exported = set()
    for port in gw.metrics.values():
        exported |= declared_metrics(port)
    queried = dashboard_metric_names(dashboard)
    assert queried, "the dashboard queries no specdec metric"
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics no process exports: {missing}"

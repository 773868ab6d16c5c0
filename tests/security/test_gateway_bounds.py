"""The orchestrator's bounds on the work of a request, through a real gateway: each one a 400 (or
a 429 for a tenant's streams and kept sessions) naming the limit and its flag, and a fuzz of the
bounded fields (stop lists, predictions, grammars, logprobs, n, keep_session) with no HTTP >= 500."""
from __future__ import annotations

import collections
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.stack import Stack, post_json

FLAGS = ("--max-grammar-bytes", "2048", "--max-prediction-bytes", "4096", "--max-top-logprobs", "5",
         "--max-streams-per-tenant", "4", "--rate-per-tenant", "0", "--max-kept-sessions-per-tenant", "3")
STATUSES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def gateway(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("gateway-bounds"))
    try:
        stack.start_service("target", "target", target_dir, wait=False)
        stack.start_service("draft", "draft", draft_dir, wait=False)
        stack.wait_serving("target", "draft")
        stack.start_orchestrator("orch", target_dir, extra=FLAGS)
        yield stack.start_gateway("orch")
    finally:
        stack.stop()


def _chat(base: str, **fields) -> tuple[int, dict]:
    body = {"model": "specdec", "messages": [{"role": "user", "content": "Name a color."}],
            "max_tokens": 2, "temperature": 0, **fields}
    return post_json(f"{base}/v1/chat/completions", body)


SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(120)}}  # > 2 kB


@pytest.mark.parametrize("fields,status,param,flag", [
    ({"stop": [f"s{i}" for i in range(33)]}, 400, "stop", "--max-stop-strings"),
    ({"stop": ["x" * 600] * 4}, 400, "stop", "--max-stop-bytes"),
    ({"prediction": {"type": "content", "content": "word " * 1000}}, 400, "prediction",
     "--max-prediction-bytes"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": SCHEMA}}},
     400, "response_format", "--max-grammar-bytes"),
    ({"constraint": {"regex": "a" * 3000}}, 400, "constraint.regex", "--max-grammar-bytes"),
    ({"logprobs": True, "top_logprobs": 6}, 400, "top_logprobs", "--max-top-logprobs"),
    ({"n": 5}, 429, None, "max_streams_per_tenant: 4 concurrent streams per tenant (this call runs 5"),
])
def test_each_bound_is_a_clear_error(gateway, fields, status, param, flag):
    got, reply = _chat(gateway, **fields)
    assert got == status, reply
    assert flag in reply["error"]["message"] and reply["error"]["param"] == param, reply


def test_kept_sessions_past_the_cap_are_a_429_naming_it(gateway):
    for _ in range(3):
        assert _chat(gateway, keep_session=True)[0] == 200
    status, reply = _chat(gateway, keep_session=True)
    assert status == 429 and reply["error"]["message"].startswith("max_kept_sessions_per_tenant:")
    assert _chat(gateway)[0] == 200  # single-turn requests still run


stops = st.one_of(st.none(), st.text(max_size=5),
                  st.lists(st.text(max_size=4), max_size=40),
                  st.lists(st.text(min_size=200, max_size=700), min_size=1, max_size=6))
texts = st.one_of(st.text(max_size=30), st.text(min_size=3500, max_size=4500))
formats = st.one_of(
    st.none(), st.just({"type": "json_object"}), st.just({"type": "text"}),
    st.builds(lambda n: {"type": "json_schema", "json_schema": {"name": "f", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}}},
        st.integers(0, 150)))
grammars = st.one_of(st.none(), st.builds(lambda r: {"regex": r}, st.one_of(
    st.sampled_from(["[a-z]{1,3}", "(yes|no)", "[", "a{9999}"]), st.text(min_size=1, max_size=20),
    st.text(min_size=2100, max_size=2300))), st.builds(lambda g: {"lark": g}, st.sampled_from(
    ['start: "x" | "y"', "start: nothing", "%%", "start: /[0-9]+/"])))


@st.composite
def bodies(draw) -> dict:
    fields = {"stop": draw(stops), "n": draw(st.one_of(st.none(), st.integers(1, 16))),
              "keep_session": draw(st.booleans()), "seed": draw(st.one_of(st.none(), st.integers(0, 99)))}
    if draw(st.booleans()):
        fields["prediction"] = {"type": "content", "content": draw(texts)}
    if draw(st.booleans()):
        fields["logprobs"] = draw(st.booleans())
        fields["top_logprobs"] = draw(st.integers(0, 20))
    grammar = draw(grammars)
    fields["response_format" if grammar is None else "constraint"] = draw(formats) if grammar is None else grammar
    return {k: v for k, v in fields.items() if v is not None}


@settings(max_examples=int(os.environ.get("SPECDEC_GATEWAY_FUZZ", "150")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(fields=bodies(), stream=st.booleans())
def test_fuzz_of_the_bounded_fields_finds_no_5xx(gateway, fields, stream):
    body = {"model": "specdec", "messages": [{"role": "user", "content": "Name a color."}],
            "max_tokens": 2, "temperature": 0, "stream": stream, **fields}
    status, reply = post_json(f"{gateway}/v1/chat/completions", body) if not stream else _streamed(
        gateway, body)
    STATUSES[status] += 1
    assert status < 500, (json.dumps(body)[:300], reply)
    if status == 400 and "above this server's limit" in reply["error"]["message"]:
        assert "(--max-" in reply["error"]["message"]  # a bound names its flag


def _streamed(base: str, body: dict) -> tuple[int, dict]:
    """A streamed request's status (an error before the stream is an ordinary JSON reply)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            events = [line for line in reply.read().decode().splitlines() if line.startswith("data:")]
            assert events and events[-1] == "data: [DONE]" or '"error"' in events[-1], events[-3:]
            return reply.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_fuzz_reached_both_answers(gateway):
    print(f"\ngateway bounds fuzz: statuses {dict(sorted(STATUSES.items()))}")
    assert STATUSES[200] and STATUSES[400] and not any(s >= 500 for s in STATUSES)

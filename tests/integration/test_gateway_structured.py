"""response_format, the `constraint` extension and logprobs through the gateway, with the real `openai` client.

On the tiny stack of tests/integration/test_gateway.py (its own instance for this module):
structured output parses and validates, and greedy it is the constrained target-only text
whatever the proposer; logprobs are the orchestrator's own (the same over gRPC), streamed or
not, and in the legacy completions shape on /v1/completions.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.integration.test_gateway import grpc_client, gw  # noqa: F401 - the module's stack

openai = pytest.importorskip("openai")

MODEL = "specdec"
CHAT = [{"role": "user", "content": "The cat sat on the mat."}]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


def _create(gw, **kw):  # noqa: F811
    return gw.openai.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 40,
                                                "temperature": 0, **kw})


@pytest.mark.parametrize("proposer", ["none", "draft", "lookup"])
def test_json_schema_response_format_validates_and_is_constrained_target_only(gw, proposer):  # noqa: F811
    ref = _create(gw, response_format=JSON_SCHEMA, extra_body={"speculation": {"proposer": "none"}})
    jsonschema.validate(json.loads(ref.choices[0].message.content), SCHEMA)
    out = _create(gw, response_format=JSON_SCHEMA, extra_body={"speculation": {"proposer": proposer, "k": 4}})
    assert out.choices[0].message.content == ref.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in _create(
        gw, response_format=JSON_SCHEMA, stream=True, extra_body={"speculation": {"proposer": proposer, "k": 4}})
        if c.choices)
    assert streamed == ref.choices[0].message.content


def test_json_object_and_the_regex_extension(gw):  # noqa: F811
    obj = _create(gw, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    phone = _create(gw, extra_body={"constraint": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone.choices[0].message.content)
    text = gw.openai.completions.create(model=MODEL, prompt="Call", max_tokens=20, temperature=0,
                                        extra_body={"constraint": {"regex": "(yes|no)"}})
    assert text.choices[0].text in ("yes", "no")


def test_chat_logprobs_are_the_orchestrators_streamed_or_not(gw, grpc_client):  # noqa: F811
    whole = _create(gw, logprobs=True, top_logprobs=3, max_tokens=12)
    content = whole.choices[0].logprobs.content
    ref = grpc_client.complete(messages=CHAT, max_new_tokens=12, logprobs=True, top_logprobs=3)
    assert len(content) == len(ref.logprobs)
    for got, want in zip(content, ref.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)  # float32: the forwards' shapes differ
        assert bytes(got.bytes) == want.token_bytes and len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob >= got.top_logprobs[1].logprob >= got.top_logprobs[2].logprob
    streamed = [e for c in _create(gw, logprobs=True, top_logprobs=3, max_tokens=12, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert whole.choices[0].message.content.startswith("".join(e.token for e in content)[:5])
    assert _create(gw, max_tokens=4).choices[0].logprobs is None  # off by default


def test_completions_logprobs_in_the_legacy_shape(gw):  # noqa: F811
    out = gw.openai.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs)


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"constraint": {"regex": "a", "lark": "start: /a/"}}, "constraint"),
    ({"constraint": {}}, "constraint"),
    ({"constraint": {"regex": "[a-"}}, "constraint.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
])
def test_bad_structured_requests_are_a_400_naming_the_field(gw, body, param):  # noqa: F811
    from tests.integration.stack import post_json

    status, reply = post_json(f"{gw.base}/v1/chat/completions",
                              {"model": MODEL, "messages": CHAT, "max_tokens": 4, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply

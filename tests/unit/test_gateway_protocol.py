"""The gateway's request models (no services): every bounded field of the published schema
gets a 400 naming it one step outside its range, and its bounds are accepted."""
from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.protocol import NEUTRAL, ChatRequest, CompletionRequest, Speculation, parse

BASE = {ChatRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        CompletionRequest: {"model": "m", "prompt": "hi"}}


def bounded_fields(model) -> list[tuple[str, str, dict]]:
    """(body path, property name, its numeric schema) for every bounded number in `model`."""
    out = []
    for name, prop in model.model_json_schema()["properties"].items():
        for option in prop.get("anyOf", [prop]):
            if option.get("type") in ("integer", "number") and (
                    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(option)):
                out.append((name, name, option))
    for name, prop in Speculation.model_json_schema()["properties"].items():
        if "maximum" in prop:
            out.append((f"speculation.{name}", name, prop))
    return out


def _body(model, path: str, value) -> dict:
    body = dict(BASE[model])
    if path.startswith("speculation."):
        body["speculation"] = {path.split(".", 1)[1]: value}
    else:
        body[path] = value
    return body


def _outside(schema: dict) -> list:
    step = 1 if schema["type"] == "integer" else 1e-3
    values = []
    if "minimum" in schema:
        values.append(schema["minimum"] - step)
    if "exclusiveMinimum" in schema:
        values.append(schema["exclusiveMinimum"])
    if "maximum" in schema:
        values.append(schema["maximum"] + step)
    if "exclusiveMaximum" in schema:
        values.append(schema["exclusiveMaximum"])
    return values


# Accepted only at a neutral value, or only together with another field (best_of = n).
CROSS_CHECKED = {*NEUTRAL, "best_of", "top_logprobs"}  # top_logprobs: only with logprobs: true
CASES = [(model, path, schema) for model in BASE for path, _, schema in bounded_fields(model)]


@pytest.mark.parametrize("model, path, schema", CASES, ids=[f"{m.__name__}.{p}" for m, p, _ in CASES])
def test_every_bounded_field_names_itself_when_out_of_range(model, path, schema):
    for value in _outside(schema):
        with pytest.raises(APIError) as err:
            parse(model, _body(model, path, value))
        assert err.value.status == 400 and err.value.param == path, (value, err.value.message)
    for bound in ("minimum", "maximum"):
        if bound in schema and path not in CROSS_CHECKED:
            parse(model, _body(model, path, schema[bound]))


def test_the_old_overflows_and_the_bounds_the_proto_needs():
    names = {p for _, p, _ in CASES}
    assert {"top_k", "speculation.k", "max_tokens", "seed", "n", "temperature", "top_p",
            "min_p", "top_logprobs", "max_completion_tokens", "best_of"} <= names
    for path in ("top_k", "speculation.k"):
        with pytest.raises(APIError) as err:
            parse(ChatRequest, _body(ChatRequest, path, 2**63))
        assert err.value.param == path


def test_unknown_and_unsupported_parameters():
    with pytest.raises(APIError) as err:
        parse(ChatRequest, {**BASE[ChatRequest], "frobnicate": 1})
    assert (err.value.code, err.value.param) == ("unknown_parameter", "frobnicate")
    with pytest.raises(APIError) as err:
        parse(ChatRequest, {**BASE[ChatRequest], "repetition_penalty": 1.3})
    assert (err.value.code, err.value.param) == ("unsupported_parameter", "repetition_penalty")
    assert "function of the tokens so far" in err.value.message  # says why
    parse(ChatRequest, {**BASE[ChatRequest], "response_format": {"type": "text"}, "tools": [],
                        "logprobs": False, "user": "u", "store": True})

"""Structured output and log-probabilities end to end (tiny target + draft + orchestrator, real Redis).

Greedy: with a grammar, every proposer at every k gives token for token what
constrained target-only decoding gives, and the output matches the grammar
(JSON parses and validates against its schema; a regex matches in full).
logprobs: the same whatever the proposer, and equal to the in-process model's
own log-softmax (masked where a grammar applies) within 1e-4.
"""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
import torch

from orchestrator.common.grammar import Constraint, Grammars

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "ok": {"type": "boolean"}}, "required": ["name", "ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
]
REGEXES = [r"(yes|no), [a-z]{2,5}\.", r"[0-9]{3}-[0-9]{4}"]
PROMPTS = ["The cat sat on the", "def add(a, b):\n    return"]
N_NEW = 48


def _json(out) -> object:
    return json.loads(out.text)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum-int", "array"])
def test_json_schema_greedy_is_constrained_target_only_for_every_proposer(client, schema):
    for prompt in PROMPTS:
        ref = client.complete(prompt, max_new_tokens=N_NEW, proposer="none", json_schema=schema)
        assert ref.stats.finish_reason == "eos", (prompt, ref.text)
        jsonschema.validate(_json(ref), schema)
        for proposer in ("draft", "lookup", "combined"):
            for k in (1, 4):
                out = client.complete(prompt, max_new_tokens=N_NEW, proposer=proposer, k=k, json_schema=schema)
                assert list(out.token_ids) == list(ref.token_ids), (proposer, k, prompt)
                assert out.text == ref.text


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_output_matches_in_full(client, pattern):
    for prompt in PROMPTS:
        ref = client.complete(prompt, max_new_tokens=N_NEW, proposer="none", regex=pattern)
        assert re.fullmatch(pattern, ref.text), ref.text
        out = client.complete(prompt, max_new_tokens=N_NEW, proposer="draft", k=3, regex=pattern)
        assert out.token_ids == ref.token_ids


def test_json_object_and_parallel_speculation(client):
    ref = client.complete(PROMPTS[0], max_new_tokens=N_NEW, proposer="none", json_object=True)
    assert ref.text.startswith("{")  # a random tiny model rarely closes a free-form object in 48 tokens
    if ref.stats.finish_reason == "eos":
        assert isinstance(_json(ref), dict)
    par = client.complete(PROMPTS[0], max_new_tokens=N_NEW, proposer="draft", k=3, parallel=True,
                          json_object=True)
    assert par.token_ids == ref.token_ids


def test_a_grammar_changes_the_output(client):
    free = client.complete(PROMPTS[0], max_new_tokens=16, proposer="none")
    fixed = client.complete(PROMPTS[0], max_new_tokens=16, proposer="none", regex="[0-9]{3}-[0-9]{4}")
    assert free.text != fixed.text and re.fullmatch("[0-9]{3}-[0-9]{4}", fixed.text)


@pytest.mark.parametrize("bad,field", [
    ({"regex": "[a-"}, "constraint.regex"),
    ({"json_schema": "{not json"}, "constraint.json_schema"),
    ({"lark": "start: nothing_defined"}, "constraint.lark"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_constraints_are_invalid_argument(client, bad, field):
    with pytest.raises(grpc.RpcError) as err:
        client.complete(PROMPTS[0], max_new_tokens=4, **bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def _reference_logprobs(tiny_pair, prompt_ids, token_ids, constraint=None) -> list[torch.Tensor]:
    """The in-process model's log-softmax at each generated position (masked by the grammar)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt_ids) + list(token_ids)])).logits[0].float()
    rows = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(token_ids)]
    if constraint is not None:
        from specdec.core import masks

        tok = AutoTokenizer.from_pretrained(tiny_pair[0])
        matcher = Grammars(tok, logits.shape[-1], [tok.eos_token_id]).matcher(constraint)
        allowed = []
        for t in token_ids:
            allowed.append(masks.unpack(torch.from_numpy(matcher.round_masks([], False).words), logits.shape[-1])[0])
            matcher.commit([t])
        rows = rows.masked_fill(~torch.stack(allowed), float("-inf"))
    return torch.log_softmax(rows, -1)


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "json"])
def test_logprobs_match_the_model_and_do_not_depend_on_the_proposer(client, tiny_pair, constrained):
    from transformers import AutoTokenizer

    kw = {"json_schema": SCHEMAS[1]} if constrained else {}
    ref = client.complete(PROMPTS[0], max_new_tokens=24, proposer="none", logprobs=True, top_logprobs=3, **kw)
    assert len(ref.logprobs) == len(ref.token_ids)
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompt_ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    want = _reference_logprobs(tiny_pair, prompt_ids, ref.token_ids,
                               Constraint("json_schema", json.dumps(SCHEMAS[1])) if constrained else None)
    for i, lp in enumerate(ref.logprobs):
        assert lp.token_id == ref.token_ids[i]
        assert abs(lp.logprob - want[i, lp.token_id].item()) < 1e-4, i
        top = torch.topk(want[i], 3)
        assert list(lp.top_ids)[0] == top.indices[0].item()
        assert torch.allclose(torch.tensor(list(lp.top_logprobs)), top.values, atol=1e-4)
    for proposer in ("draft", "combined"):
        out = client.complete(PROMPTS[0], max_new_tokens=24, proposer=proposer, k=4, logprobs=True,
                              top_logprobs=3, **kw)
        assert out.token_ids == ref.token_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert list(a.top_ids) == list(b.top_ids)


def test_logprobs_without_top_and_off_by_default(client):
    out = client.complete(PROMPTS[0], max_new_tokens=8, logprobs=True)
    assert len(out.logprobs) == len(out.token_ids) and all(not lp.top_ids for lp in out.logprobs)
    assert not client.complete(PROMPTS[0], max_new_tokens=8).logprobs


def test_logprobs_carry_each_tokens_bytes(client, tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    out = client.complete(PROMPTS[0], max_new_tokens=12, proposer="none", logprobs=True, top_logprobs=2)
    assert b"".join(lp.token_bytes for lp in out.logprobs if lp.token_id != tok.eos_token_id).decode(
        errors="replace") == tok.decode([t for t in out.token_ids if t != tok.eos_token_id])
    assert all(len(lp.top_bytes) == 2 for lp in out.logprobs)

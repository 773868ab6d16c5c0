"""The OpenAI API's schemas, bad input, n > 1 and Predicted Outputs, with the real `openai` client.

The tiny stack of tests/integration/test_gateway.py (its own instance for this module) serves
everything but the rewrite task, which needs a model that rewrites: the embedded default target
(SmolLM2-135M-Instruct) behind its own orchestrator and gateway.

The schema-driven fuzz (schemathesis, from the gateway's own /openapi.json) sends about
FUZZ_EXAMPLES requests here; SPECDEC_API_FUZZ_EXAMPLES=N sends about N instead.
"""
from __future__ import annotations

import collections
import json
import os
import urllib.request
from types import SimpleNamespace

import pytest

from gateway.protocol import NEUTRAL
from gateway.responses.translate import NEUTRAL as RESPONSES_NEUTRAL
from gateway.schemas import ChatCompletion, ChatCompletionChunk, TextCompletion
from tests.integration.stack import Stack, post_json
from tests.integration.test_gateway import disconnect_mid_stream, gw  # noqa: F401 - the module's stack and gateway

openai = pytest.importorskip("openai")

MODEL = "specdec"
CHAT = [{"role": "user", "content": "The cat sat on the mat."}]
FUZZ_EXAMPLES = int(os.environ.get("SPECDEC_API_FUZZ_EXAMPLES", "0")) or 240

# Every parameter of OpenAI's chat and completions create calls (and the extensions).
CHAT_PARAMS = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
}
COMPLETION_PARAMS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
}
EXTENSIONS = {"speculation", "constraint", "session_id", "keep_session", "top_k", "min_p",
              "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
              "include_stop_str_in_output"}


def _chat(gw, **body) -> tuple[int, dict]:  # noqa: F811 - the fixture, passed in
    return post_json(f"{gw.base}/v1/chat/completions", {"model": MODEL, "messages": CHAT, **body})


# ------------------------------------------------------------------- schemas


@pytest.fixture(scope="module")
def spec(gw):  # noqa: F811
    with urllib.request.urlopen(f"{gw.base}/openapi.json", timeout=10) as reply:
        return json.loads(reply.read())


def test_openapi_publishes_every_parameter_with_its_range(spec):
    schemas = spec["components"]["schemas"]
    chat, completion = schemas["ChatRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert CHAT_PARAMS | EXTENSIONS <= set(chat), CHAT_PARAMS - set(chat)
    assert COMPLETION_PARAMS | EXTENSIONS <= set(completion), COMPLETION_PARAMS - set(completion)
    assert schemas["ChatRequest"]["additionalProperties"] is False
    assert chat["top_k"]["maximum"] == 2**31 - 1 and chat["top_k"]["minimum"] == -1  # vLLM's -1: off
    assert chat["min_tokens"]["maximum"] == 2**32 - 1 and "continuous_usage_stats" in schemas[
        "StreamOptions"]["properties"]
    assert schemas["Speculation"]["properties"]["k"]["maximum"] == 2**32 - 1
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}
    assert chat["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 16}
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    for path, request, response in (("/v1/chat/completions", "ChatRequest", "ChatCompletion"),
                                    ("/v1/completions", "CompletionRequest", "TextCompletion")):
        post = spec["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response)
        assert "text/event-stream" in post["responses"]["200"]["content"]
        assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "ChatCompletionChunk" in schemas and "Usage" in schemas


def test_responses_validate_against_the_published_models(gw):  # noqa: F811
    options = dict(model=MODEL, max_tokens=6, temperature=0.8, seed=5, n=2)
    whole = gw.openai.chat.completions.with_raw_response.create(messages=CHAT, **options)
    ChatCompletion.model_validate(json.loads(whole.text))
    text = gw.openai.completions.with_raw_response.create(prompt="The cat", **options)
    TextCompletion.model_validate(json.loads(text.text))
    for chunk in gw.openai.chat.completions.create(messages=CHAT, stream=True,
                                                   stream_options={"include_usage": True}, **options):
        ChatCompletionChunk.model_validate(chunk.model_dump(exclude_unset=True))
    for chunk in gw.openai.completions.create(prompt="The cat", stream=True, **options):
        TextCompletion.model_validate(chunk.model_dump(exclude_unset=True))


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("body, param", [
    ({"top_k": 2**63}, "top_k"),                      # the fuzz's old 500s
    ({"speculation": {"k": 2**63}}, "speculation.k"),
    ({"speculation": {"k": -1}}, "speculation.k"),
    ({"speculation": {"proposer": "oracle"}}, "speculation.proposer"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 2**63}, "max_completion_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"n": 2**63}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1}, "min_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"session_id": "s" * 257}, "session_id"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prediction": {"type": "content", "content": 5}}, "prediction"),
    ({"prediction": {"type": "diff", "content": "x"}}, "prediction"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"n": 2, "keep_session": True}, "n"),
])
def test_every_out_of_range_value_is_a_400_naming_its_field(gw, body, param):  # noqa: F811
    status, reply = _chat(gw, **{"max_tokens": 2, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["type"] == "invalid_request_error"


def test_completions_overflow_and_best_of(gw):  # noqa: F811
    url = f"{gw.base}/v1/completions"
    for body, param in (({"top_k": 2**63}, "top_k"), ({"best_of": 3}, "best_of"),
                        ({"logprobs": 6}, "logprobs")):
        status, reply = post_json(url, {"model": MODEL, "prompt": "x", **body})
        assert (status, reply["error"]["param"]) == (400, param), reply
    status, reply = post_json(url, {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2,
                                    "best_of": 2, "temperature": 0})
    assert status == 200 and len(reply["choices"]) == 2


@pytest.mark.parametrize("kwargs, param", [
    # The tiny template takes no tools: tool_choice auto (the default with tools) cannot be served.
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tool_choice"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 1.3}), "repetition_penalty"),
])
def test_not_yet_supported_parameters_are_a_clear_400(gw, kwargs, param):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        gw.openai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kwargs)
    assert err.value.body["param"] == param and err.value.body["code"] == "unsupported_parameter"
    assert "not supported" in err.value.body["message"]


def test_a_lone_surrogate_is_a_400(gw):  # noqa: F811
    request = urllib.request.Request(
        f"{gw.base}/v1/completions", headers={"Content-Type": "application/json"},
        data=b'{"model": "specdec", "prompt": "\\ud800", "max_tokens": 2}')
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400


# ------------------------------------------------------------------- n > 1


def test_n_choices_streamed_and_not(gw):  # noqa: F811
    # A sampled text is a function of the seed, the proposer and k (not of timing): both fixed.
    options = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=42,
                   extra_body={"speculation": {"proposer": "draft", "k": 3}})
    one = gw.openai.chat.completions.create(**options)
    three = gw.openai.chat.completions.create(n=3, **options)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert texts[0] == one.choices[0].message.content  # choice 0 is the n = 1 answer
    assert len(set(texts)) == 3  # each choice its own seed
    per_choice = three.usage.model_extra["speculation"]["choices"]
    assert [c["seed"] for c in per_choice][0] == 42 and len({c["seed"] for c in per_choice}) == 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens

    streamed = collections.defaultdict(str)
    finishes = {}
    for chunk in gw.openai.chat.completions.create(n=3, stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert [streamed[i] for i in range(3)] == texts
    assert finishes == {c.index: c.finish_reason for c in three.choices}


def test_a_disconnect_mid_stream_frees_every_choices_kv(gw):  # noqa: F811
    disconnect_mid_stream(gw, n=3)


def test_n_on_completions(gw):  # noqa: F811
    done = gw.openai.completions.create(model=MODEL, prompt="The cat", max_tokens=8, n=2,
                                        temperature=0)
    assert [c.index for c in done.choices] == [0, 1]
    assert done.choices[0].text == done.choices[1].text  # greedy: the same text twice


# ------------------------------------------------------------------- Predicted Outputs (tiny)


def test_prediction_keeps_the_text_and_reports_its_tokens(gw):  # noqa: F811
    options = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    plain = gw.openai.chat.completions.create(**options)
    text = plain.choices[0].message.content
    predicted = gw.openai.chat.completions.create(
        prediction={"type": "content", "content": [{"type": "text", "text": text}]}, **options)
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    speculation = predicted.usage.model_extra["speculation"]
    assert speculation["proposer"] == "prediction"
    assert details.accepted_prediction_tokens == speculation["accepted_tokens"] > 0
    assert details.rejected_prediction_tokens == (speculation["drafted_tokens"]
                                                  - speculation["accepted_tokens"])
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    status, reply = _chat(gw, max_tokens=2, prediction={"type": "content", "content": "x"},
                          speculation={"proposer": "draft"})
    assert (status, reply["error"]["param"]) == (400, "prediction")


# ------------------------------------------------------------------- schema-driven fuzz


def _fuzz(base: str, doc: dict, total: int) -> tuple[collections.Counter, list]:
    """Send about `total` schemathesis cases (valid and invalid) to every operation of `doc`.

    Valid chat / completion / responses bodies name the served model, ask for at most 4 tokens and leave
    out the parameters accepted only at their default here (and unknown session ids), so
    they reach the orchestrator and the budget goes to requests, not to decoding.
    """
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(doc)
    operations = [op.ok() for op in schema.get_all_operations()]
    generating = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}
    others = max(1, sum(op.path not in generating for op in operations))
    statuses: collections.Counter = collections.Counter()
    failures: list = []

    def run(operation, mode, examples: int) -> None:
        bounded = mode is GenerationMode.POSITIVE and operation.path in generating

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def send(case) -> None:
            if bounded and isinstance(case.body, dict):
                case.body["model"] = MODEL
                limit = "max_output_tokens" if operation.path == "/v1/responses" else "max_tokens"
                for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if isinstance(case.body.get(key), int):
                        case.body[key] = min(case.body[key], 4)
                case.body.setdefault(limit, 4)
                for key in (*NEUTRAL, *RESPONSES_NEUTRAL, "best_of", "session_id", "previous_response_id"):
                    case.body.pop(key, None)
            response = case.call(base_url=base, timeout=60)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append((operation.label, case.body, response.text[:300]))

        try:
            send()
        except Unsatisfiable:  # no invalid case exists (an operation without parameters)
            pass

    for operation in operations:
        share = 0.8 / len(generating) if operation.path in generating else 0.2 / others
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run(operation, mode, max(1, round(total * share / 2)))
    return statuses, failures


def test_schema_driven_fuzz_finds_no_5xx(gw, spec):  # noqa: F811
    statuses, failures = _fuzz(gw.base, spec, FUZZ_EXAMPLES)
    sent = sum(statuses.values())
    print(f"\napi fuzz: {sent} requests, statuses {dict(sorted(statuses.items()))}, "
          f"{len(failures)} >= 500")
    assert sent >= FUZZ_EXAMPLES * 0.5, statuses
    assert statuses[200] > 0 and statuses[400] > 0, statuses  # both kinds of case got through
    assert not failures, failures[:5]
    assert gw.openai.models.list().data  # the gateway is still up


# ------------------------------------------------------------------- the rewrite task (real model)

REWRITE = ("Rewrite the following paragraph, changing the name Alice to Carol. Output only the "
           "paragraph.\n\nAlice opened the old wooden door and stepped into the garden. The roses "
           "were in full bloom, and a small bird sang from the branch of an apple tree. Alice sat "
           "down on the stone bench, closed her eyes, and listened to the quiet afternoon.")


@pytest.fixture(scope="module")
def default_gw(tmp_path_factory):
    """The embedded default target (no draft) behind an orchestrator and a gateway."""
    from engine.model.loader import resolve

    stack = Stack(logs=tmp_path_factory.mktemp("default-gateway-logs"))
    try:
        stack.start_service("target", "target", None)
        stack.start_orchestrator("orch", resolve(None)[0])
        base = stack.start_gateway("orch")
        yield SimpleNamespace(base=base, openai=openai.OpenAI(
            base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300))
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_correct_prediction_on_a_rewrite_task_cuts_target_passes(default_gw):
    """Plain OpenAI requests (no extension fields): the orchestrator's default k, and no
    speculation gate for a prediction (so this is not timing-dependent)."""
    options = dict(model=MODEL, messages=[{"role": "user", "content": REWRITE}], max_tokens=96,
                   temperature=0)
    plain = default_gw.openai.chat.completions.create(
        **options, extra_body={"speculation": {"proposer": "none"}})
    text = plain.choices[0].message.content
    assert "Carol" in text, text  # the model does the task
    plain_spec = plain.usage.model_extra["speculation"]
    assert plain_spec["target_passes"] == plain.usage.completion_tokens  # target-only: 1 per token
    for k in (None, 8):
        predicted = default_gw.openai.chat.completions.create(
            prediction={"type": "content", "content": text}, **options,
            extra_body={"speculation": {"k": k}} if k else None)
        assert predicted.choices[0].message.content == text
        spec = predicted.usage.model_extra["speculation"]
        ratio = spec["target_passes"] / predicted.usage.completion_tokens
        print(f"\nrewrite task, k {k or 'default'}: {predicted.usage.completion_tokens} tokens, "
              f"target passes per token {ratio:.3f} with the prediction, 1.000 without")
        assert ratio <= 0.35, spec
        assert predicted.usage.completion_tokens_details.accepted_prediction_tokens >= (
            predicted.usage.completion_tokens - spec["target_passes"])
    # The caller's own guess of the answer (the paragraph with the name replaced) is not the
    # exact answer, but re-alignment still takes most of it; the text stays the same.
    paragraph = REWRITE.split("\n\n", 1)[1].replace("Alice", "Carol")
    guessed = default_gw.openai.chat.completions.create(
        prediction={"type": "content", "content": paragraph}, **options)
    assert guessed.choices[0].message.content == text
    guessed_spec = guessed.usage.model_extra["speculation"]
    print(f"rewrite task, the edited paragraph as the prediction: target passes per token "
          f"{guessed_spec['target_passes'] / guessed.usage.completion_tokens:.3f}")
    assert guessed_spec["target_passes"] < plain_spec["target_passes"]

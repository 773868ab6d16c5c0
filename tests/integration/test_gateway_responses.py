"""The Responses API (/v1/responses) and /tokenize, /detokenize, with the real `openai` client.

On the tiny stack of tests/integration/test_gateway.py (its own instance for this module):
responses.create whole and streamed (the events parsed by the SDK's own types, in the documented
order), three turns chained by previous_response_id (each later turn served from the kept
session's KV caches, the text chat completions' for the whole history), GET and DELETE, unknown
and foreign ids, text.format json_schema, a function tool, the tokenizer endpoints against the
tokenizer itself, and one OpenAI Agents SDK run with a tool.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Annotated

import jsonschema
import pytest
from pydantic import Field

from gateway.schemas import Detokenized, ResponseObject, Tokenized
from tests.integration.stack import post_json
from tests.integration.test_gateway import grpc_client, gw  # noqa: F401 - the module's stack
from tests.integration.test_gateway_api import default_gw  # noqa: F401 - the embedded target's

openai = pytest.importorskip("openai")
from openai.types import responses as rt  # noqa: E402

MODEL = "specdec"
SAY = "The cat sat on the mat."
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _create(gw, **kw):  # noqa: F811
    return gw.openai.responses.create(**{"model": MODEL, "max_output_tokens": 12, "temperature": 0, **kw})


def _chat(gw, messages, max_tokens=12, **kw):  # noqa: F811
    return gw.openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                             temperature=0, **kw)


def _request(gw, method: str, path: str, token: str | None = None) -> tuple[int, dict]:  # noqa: F811
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"{gw.base}{path}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_whole_response_is_chat_completions_text(gw):  # noqa: F811
    got = _create(gw, input=SAY, instructions="Be brief.")
    ref = _chat(gw, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SAY}])
    assert isinstance(got, rt.Response) and got.object == "response" and got.id.startswith("resp_")
    assert got.output_text == ref.choices[0].message.content
    assert [item.type for item in got.output] == ["message"]
    assert got.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")
    if got.status == "incomplete":
        assert got.incomplete_details.reason == "max_output_tokens"
    u = got.usage
    assert (u.input_tokens, u.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens == 0
    assert got.instructions == "Be brief." and got.temperature == 0 and got.store
    # The published schema is what is sent (it forbids unknown fields).
    status, body = post_json(f"{gw.base}/v1/responses", {"model": MODEL, "input": SAY, "max_output_tokens": 4,
                                                         "temperature": 0, "store": False})
    assert status == 200 and ResponseObject.model_validate(body).store is False


def _check_order(events: list) -> None:
    """The documented order for one message item, nothing dropped, numbered 0, 1, 2..."""
    kinds = [e.type for e in events]
    assert kinds[:4] == TEXT_EVENTS and kinds[-4:-1] == CLOSING, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_streamed_events_parse_as_the_sdks_types_in_the_documented_order(gw):  # noqa: F811
    whole = _create(gw, input=SAY)
    events = list(_create(gw, input=SAY, stream=True))
    assert all(isinstance(e, rt.ResponseStreamEvent.__args__[0].__args__) for e in events)  # typed, none unknown
    _check_order(events)
    deltas = [e for e in events if isinstance(e, rt.ResponseTextDeltaEvent)]
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert {e.item_id for e in deltas} == {events[2].item.id}
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id
    # The SDK's own stream helper accumulates the events into a snapshot (it refuses one out of
    # order); its final response needs response.completed (at max_output_tokens: incomplete).
    with gw.openai.responses.stream(model=MODEL, input=SAY, max_output_tokens=12, temperature=0) as stream:
        seen = list(stream)
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == whole.output_text
        if seen[-1].type == "response.completed":
            assert stream.get_final_response().output_text == whole.output_text


def chain(client, asks: list[str], max_output_tokens: int = 12) -> list[tuple]:
    """Turns chained by previous_response_id (the last one streamed: a streamed response is
    stored too), each with chat completions' answer for the whole history (no session)."""
    history: list[dict] = []
    previous, turns = None, []
    for turn, ask in enumerate(asks):
        kw = {"previous_response_id": previous.id} if previous else {}
        kw.update(model=MODEL, input=ask, max_output_tokens=max_output_tokens, temperature=0)
        if turn == len(asks) - 1:
            events = list(client.responses.create(stream=True, **kw))
            _check_order(events)
            got = events[-1].response
        else:
            got = client.responses.create(**kw)
        history.append({"role": "user", "content": ask})
        ref = client.chat.completions.create(model=MODEL, messages=history, max_tokens=max_output_tokens,
                                             temperature=0)
        turns.append((got, ref, list(history)))
        history.append({"role": "assistant", "content": got.output_text})
        previous = got
    return turns


def test_three_turns_by_previous_response_id_reuse_the_kv_and_equal_chat_completions(gw, grpc_client,  # noqa: F811
                                                                                      tokenizer):
    turns = chain(gw.openai, [SAY, "And then?", "Ok."])
    for i, (got, ref, history) in enumerate(turns):
        assert got.output_text == ref.choices[0].message.content, i  # exact: the whole history's answer
        assert got.usage.input_tokens == ref.usage.prompt_tokens
        if i == 0:
            continue
        previous = turns[i - 1][0]
        assert got.previous_response_id == previous.id
        # The previous turn's prompt and its generated tokens are the session's; the new prompt
        # renders that output as text again, which re-tokenizes to the same ids where the model
        # generated the canonical tokenization (a trained model's usual case; this random tiny
        # one often does not), and the cache serves the common prefix.
        generated = grpc_client.complete(messages=turns[i - 1][2], max_new_tokens=12, temperature=0).token_ids
        canonical = tokenizer.encode(previous.output_text, add_special_tokens=False)
        same = next((n for n, (a, b) in enumerate(zip(generated, canonical)) if a != b),
                    min(len(generated), len(canonical)))
        cached = got.usage.input_tokens_details.cached_tokens
        print(f"turn {i + 1}: cached {cached} of {got.usage.input_tokens}; previous input + output "
              f"{previous.usage.input_tokens} + {previous.usage.output_tokens} (canonical for {same})")
        # The last generated token has no KV yet (it was sampled, never run through the target).
        assert cached >= previous.usage.input_tokens + min(same, previous.usage.output_tokens - 1)
    gw.openai.responses.delete(turns[-1][0].id)


def test_get_delete_and_unknown_or_foreign_ids_are_a_404(gw):  # noqa: F811
    got = _create(gw, input=SAY)
    again = gw.openai.responses.retrieve(got.id)
    assert again.model_dump() == got.model_dump()
    # Another caller (another token) sees nothing: retrieve, continue or delete.
    other = openai.OpenAI(base_url=f"{gw.base}/v1", api_key="another-caller", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(got.id)
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.create(model=MODEL, input="Hi", previous_response_id=got.id)
    assert err.value.body["param"] == "previous_response_id"
    status, body = _request(gw, "DELETE", f"/v1/responses/{got.id}", token="another-caller")
    assert status == 404 and set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "response_not_found"
    # The owner deletes it; then it is gone for everyone.
    gw.openai.responses.delete(got.id)
    for call in (lambda: gw.openai.responses.retrieve(got.id), lambda: gw.openai.responses.delete(got.id),
                 lambda: _create(gw, input="Hi", previous_response_id=got.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert _request(gw, "GET", "/v1/responses/resp_unknown")[0] == 404
    # store: false keeps nothing.
    unstored = _create(gw, input=SAY, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        gw.openai.responses.retrieve(unstored.id)


def test_text_format_json_schema_goes_through_the_grammar(gw):  # noqa: F811
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}}
    got = _create(gw, input=SAY, text=fmt, max_output_tokens=40)
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    ref = _chat(gw, [{"role": "user", "content": SAY}], max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}})
    assert got.output_text == ref.choices[0].message.content
    assert got.text.format.type == "json_schema"


def test_a_function_tool_call_then_its_output(gw):  # noqa: F811
    choice = {"type": "function", "name": "get_weather"}
    got = _create(gw, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=40)
    (call,) = got.output
    assert isinstance(call, rt.ResponseFunctionToolCall) and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(_create(gw, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                          max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
        == events[-1].response.output[0].arguments == call.arguments
    # The tool's result continues the conversation (the stored call and this output).
    after = _create(gw, previous_response_id=got.id, tools=[WEATHER], tool_choice="none",
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}])
    ref = _chat(gw, [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny."}])
    assert after.output_text == ref.choices[0].message.content


def test_bad_requests_name_their_parameter(gw):  # noqa: F811
    for body, param in [({"input": SAY, "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": SAY, "background": True}, "background"),
                        ({"input": [{"type": "message", "role": "user",
                                     "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
                        ({"input": ""}, "input"), ({"input": SAY, "bogus": 1}, "bogus")]:
        status, reply = post_json(f"{gw.base}/v1/responses", {"model": MODEL, **body})
        assert status == 400 and reply["error"]["param"] == param, (body, reply)


# ------------------------------------------------------------------- /tokenize, /detokenize


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


def test_tokenize_counts_are_the_tokenizers_own(gw, tokenizer):  # noqa: F811
    status, got = post_json(f"{gw.base}/tokenize", {"model": MODEL, "prompt": SAY, "return_token_strs": True})
    assert status == 200 and Tokenized.model_validate(got)
    ids = tokenizer.encode(SAY, add_special_tokens=False)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] > 0
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    special = post_json(f"{gw.base}/tokenize", {"prompt": SAY, "add_special_tokens": True})[1]
    assert special["tokens"] == tokenizer.encode(SAY, add_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SAY}]
    status, chat = post_json(f"{gw.base}/tokenize", {"model": MODEL, "messages": messages})
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(templated, add_special_tokens=False)
    assert chat["count"] == _chat(gw, messages, max_tokens=1).usage.prompt_tokens  # what a generation counts
    assert post_json(f"{gw.base}/tokenize", {"model": "nope", "prompt": SAY})[0] == 404
    assert post_json(f"{gw.base}/tokenize", {"prompt": SAY, "messages": messages})[0] == 400


def test_detokenize_is_the_tokenizers_decode(gw, tokenizer):  # noqa: F811
    ids = tokenizer.encode("<|im_start|>user\n" + SAY, add_special_tokens=False)
    status, got = post_json(f"{gw.base}/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and Detokenized.model_validate(got)
    assert got["prompt"] == tokenizer.decode(ids) == "<|im_start|>user\n" + SAY
    status, bad = post_json(f"{gw.base}/detokenize", {"tokens": [len(tokenizer) + 5]})
    assert status == 400 and bad["error"]["param"] == "tokens"


# ------------------------------------------------------------------- the OpenAI Agents SDK


def test_an_agents_sdk_run_with_a_tool(gw):  # noqa: F811
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"Sunny in {city}."

    # The tiny template takes no tools, so the call is forced (tool_choice required, generated under
    # the function's schema) and the run ends with the tool's result.
    client = openai.AsyncOpenAI(base_url=f"{gw.base}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                             max_tokens=64),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?"))
    assert len(called) == 1 and result.final_output == f"Sunny in {called[0]}."


# ------------------------------------------------------------------- a trained model


@pytest.mark.slow
def test_three_turns_on_the_embedded_target_are_served_from_the_kept_session(default_gw):  # noqa: F811
    """SmolLM2-135M-Instruct writes canonical tokens: every later turn's cache holds the whole
    previous turn, its prompt and its output, but for the output's last token, which was sampled
    and never run through the target (so it has no KV to reuse)."""
    turns = chain(default_gw.openai, ["Name three colors.", "And three animals?", "Thanks!"],
                  max_output_tokens=16)
    for i, (got, ref, _) in enumerate(turns):
        assert got.output_text == ref.choices[0].message.content, i
        if i:
            previous = turns[i - 1][0]
            cached = got.usage.input_tokens_details.cached_tokens
            print(f"embedded turn {i + 1}: cached {cached} of {got.usage.input_tokens}; previous input + "
                  f"output {previous.usage.input_tokens} + {previous.usage.output_tokens}")
            assert cached >= previous.usage.input_tokens + previous.usage.output_tokens - 1

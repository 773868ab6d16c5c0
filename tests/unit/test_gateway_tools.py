"""gateway.tools without services: which requests are served how, the calls parsed out of text,
and the deltas a streamed choice sends (they add up to the non-streamed message)."""
from __future__ import annotations

import json

import pytest

from gateway import tools
from gateway.errors import APIError
from gateway.protocol import ChatRequest, chat_messages, parse
from gateway.schemas import ChatCompletionChunk, ChatMessageOut

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "description": "now"}}


def request(**body) -> ChatRequest:
    return parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def test_the_plan_of_each_tool_choice():
    assert tools.plan(request(), "") is None
    assert tools.plan(request(tools=[WEATHER], tool_choice="none"), "") is None
    named = tools.plan(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                   "function": {"name": "weather"}}), "")
    assert named.forced and named.name == "weather" and named.schema == WEATHER["function"]["parameters"]
    only = tools.plan(request(tools=[TIME], tool_choice="required"), "")
    assert only.name == "time" and only.schema == {"type": "object"}  # no parameters: any object
    both = tools.plan(request(tools=[WEATHER, TIME], tool_choice="required"), "")
    assert both.name is None and [o["properties"]["name"] for o in both.schema["anyOf"]] == [
        {"const": "weather"}, {"const": "time"}]
    auto = tools.plan(request(tools=[WEATHER]), "hermes")  # auto is the default with tools
    assert not auto.forced and auto.format == "hermes"
    assert tools.options(named) == {"tools": [WEATHER, TIME], "json_schema": WEATHER["function"]["parameters"]}
    assert tools.options(auto) == {"tools": [WEATHER]}


@pytest.mark.parametrize("body, fmt, status, phrase", [
    (dict(tools=[WEATHER]), "", 400, "no tool support"),
    (dict(tools=[WEATHER], tool_choice="auto"), None, 503, "has not said"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "", 400, "no tool named"),
    (dict(tool_choice="required"), "", 400, "requires tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "", 400,
     "not with response_format"),
])
def test_what_cannot_be_served_is_an_error_naming_tool_choice(body, fmt, status, phrase):
    with pytest.raises(APIError) as err:
        tools.plan(request(**body), fmt)
    assert (err.value.status, err.value.param) == (status, "tool_choice") and phrase in err.value.message


def test_calls_parsed_out_of_text():
    auto = tools.plan(request(tools=[WEATHER, TIME]), "hermes")
    content, calls = tools.parse(auto, 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": '
                                       '{"city": "Paris"}}\n</tool_call>')
    assert content == "Let me look.\n" and calls[0]["function"] == {"name": "weather",
                                                                  "arguments": '{"city": "Paris"}'}
    assert tools.parse(auto, "<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert tools.parse(auto, '<tool_call>{"name": "other", "arguments": {}}</tool_call>')[1] == []
    bare = tools.plan(request(tools=[TIME]), "json")
    assert tools.parse(bare, ' {"name": "time", "parameters": {}} ')[1][0]["function"]["arguments"] == "{}"
    assert tools.parse(bare, "It is noon.") == ("It is noon.", [])
    forced = tools.plan(request(tools=[WEATHER, TIME], tool_choice="required"), "")
    assert tools.parse(forced, '{"name":"weather","arguments":{"city":"Oslo"}}')[1][0]["function"] == {
        "name": "weather", "arguments": '{"city": "Oslo"}'}


def _streamed(plan, pieces: list[str], reason: str = "stop") -> tuple[dict, str]:
    """The message a client assembles from the streamed deltas, and the finish reason."""
    out = tools.output(plan)
    deltas = [out.opening()] + [d for p in pieces for d in out.push(p)] + out.finish()
    message: dict = {"content": None, "tool_calls": {}}
    for delta in deltas:
        ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0,
                                           "model": "m", "system_fingerprint": None, "choices": [
                                               {"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": None}]})
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls", ()):
            entry = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
            entry.update({k: v for k, v in call.items() if k in ("id", "type")})
            entry["name"] = call["function"].get("name", entry.get("name"))
            entry["arguments"] += call["function"].get("arguments") or ""
    return message, out.finish_reason(reason)


@pytest.mark.parametrize("body, fmt, text", [
    (dict(tools=[WEATHER], tool_choice="required"), "", '{"city":"Paris"}'),
    (dict(tools=[WEATHER, TIME], tool_choice="required"), "", '{"name":"time","arguments":{}}'),
    (dict(tools=[WEATHER]), "hermes", 'Sure. <tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'),
    (dict(tools=[WEATHER]), "hermes", "No call here, just <tool text."),
    (dict(tools=[WEATHER]), "json", '{"name": "weather", "arguments": {"city": "Rome"}}'),
    (dict(tools=[WEATHER]), "json", "Plain words."),
])
def test_streamed_deltas_add_up_to_the_whole_message(body, fmt, text):
    plan = tools.plan(request(**body), fmt)
    whole = tools.message(plan, text)
    ChatMessageOut.model_validate(whole)
    for size in (1, 3, 7, len(text)):
        streamed, reason = _streamed(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert streamed["content"] == whole["content"], size
        calls = [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(streamed["tool_calls"].items())]
        assert calls == [c["function"] for c in whole.get("tool_calls", ())]
        assert reason == tools.finish_reason(plan, text, "stop")
        assert reason == ("tool_calls" if whole.get("tool_calls") else "stop")
    if whole.get("tool_calls"):
        json.loads(whole["tool_calls"][0]["function"]["arguments"])


def test_tool_messages_and_calls_in_the_history():
    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = chat_messages(req)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "weather" and messages[1]["content"] == ""
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}

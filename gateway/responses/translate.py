"""The Responses API (POST /v1/responses) as a translation onto the chat path.

- In: a request becomes a gateway.protocol.ChatRequest (instructions and input items ->
  messages after the stored conversation of `previous_response_id`; text.format ->
  response_format, on the grammar path; tools and tool_choice -> chat's, on gateway.tools'
  plan; max_output_tokens -> max_tokens), so it takes the chat path's checks, Generate
  options and exactness: greedy, the text is chat completions' for the same conversation.
- Out: the deltas of the chat path's gateway.tools.Output (text, a forced call's arguments,
  parsed calls) become output items, a `message` with one `output_text` part and
  `function_call`s, and the stream's events in the documented order: response.created,
  response.in_progress, then per item output_item.added, (content_part.added,
  output_text.delta..., output_text.done, content_part.done | function_call_arguments.delta...,
  function_call_arguments.done), output_item.done, and last response.completed (or
  response.incomplete at max_output_tokens). A whole response is the same writer fed the
  whole text at once.
- usage: input_tokens, input_tokens_details.cached_tokens (the prompt tokens a kept session's
  KV caches served), output_tokens, and chat's `speculation` extension.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from gateway import tools
from gateway.errors import APIError
from gateway.protocol import (
    INT32, MAX_SESSION_ID, UINT32, FINISH_REASONS, ChatRequest, GrammarConstraint, Speculation, _Strict,
    parse, usage, validate,
)

# Declared, not supported: accepted at these values only (see gateway.protocol.NEUTRAL).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "auto", "disabled"),  # nothing is truncated: a prompt too long is a 400
}
# Accepted and not used: user, metadata (echoed), service_tier, prompt_cache_key,
# safety_identifier, include, reasoning (no reasoning model), parallel_tool_calls and
# max_tool_calls (one call, or the calls the template's format holds), stream_options.
# A chat parameter's error names the Responses parameter it came from.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class InputPart(BaseModel):
    """A content part; text parts only ("input_text", "output_text", "text")."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str = ""


class InputItem(BaseModel):
    """An input item: a message (EasyInputMessage or an earlier output message sent back), an
    earlier `function_call`, or a `function_call_output` (a tool's result). Items sent back as
    they came out carry more fields (id, status, annotations): ignored."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: Annotated[Union[TextFormatText, TextFormatJSONObject, TextFormatJSONSchema],
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    model: str
    input: str | list[InputItem] = ""
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=MAX_SESSION_ID)
    store: bool | None = True
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # Extensions (as chat's): the sampling seed, vLLM's top_k and min_p, stop strings, and
    # specdec's speculation and constraint.
    seed: int | None = Field(None, ge=0, lt=2**64)
    top_k: int = Field(0, ge=-1, le=INT32)
    min_p: float = Field(0.0, ge=0, lt=1)
    stop: str | list[str] | None = None
    speculation: Speculation | None = None
    constraint: GrammarConstraint | None = None


def parse_request(body: Any) -> ResponsesRequest:
    return validate(ResponsesRequest, body, NEUTRAL)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (a function_call joins the assistant message
    before it, as one assistant turn's tool_calls)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}] if req.input else []
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        if item.type == "message":
            if item.role is None:
                raise _bad(i, "role: required for a message")
            out.append({"role": item.role, "content": _text(i, item.content)})
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise _bad(i, "a function_call needs call_id and name")
            call = tools.call(item.name, item.arguments or "", item.call_id)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            if not item.call_id:
                raise _bad(i, "a function_call_output needs call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(i, item.output)})
    return out


def _text(i: int, content: str | list[InputPart] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    for part in content:
        if part.type not in ("input_text", "output_text", "text"):
            raise APIError(400, f"input[{i}].content: only text parts are supported, got {part.type!r}",
                           param="input", code="unsupported_parameter")
    return "".join(part.text for part in content)


def _bad(i: int, message: str) -> APIError:
    return APIError(400, f"input[{i}]: {message}", param="input", code="invalid_value")


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]], *, session_id: str = "",
                 keep: bool = False) -> ChatRequest:
    """The chat request this turn is: `messages` (the conversation, this turn's input included)
    after the instructions."""
    if not messages:
        raise APIError(400, "input: required (a string or a list of items)", param="input",
                       code="invalid_value")
    fmt = req.text.format if req.text is not None else None
    body: dict[str, Any] = {
        "model": req.model, "stream": req.stream,
        "messages": ([{"role": "system", "content": req.instructions}] if req.instructions else []) + messages,
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p, "stop": req.stop,
        "session_id": session_id, "keep_session": keep,
    }
    if fmt is not None:
        body["response_format"] = (
            {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
            if isinstance(fmt, TextFormatJSONSchema) else {"type": fmt.type})
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str) else
                               {"type": "function", "function": {"name": req.tool_choice.name}})
    for name in ("speculation", "constraint"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value.model_dump(exclude_none=True)
    try:
        return parse(ChatRequest, {k: v for k, v in body.items() if v is not None})
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param, exc.param)
        raise


def skeleton(ident: str, req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The Response object before any output (status in_progress)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice or "auto"
    return {
        "id": ident, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": model, "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": bool(req.store),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
        "usage": None, "user": req.user, "metadata": req.metadata or {},
    }


def response_usage(stats) -> dict[str, Any]:
    """The Responses API's usage of one generation's Stats (chat's usage, renamed)."""
    chat = usage([stats])
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"], "speculation": chat["speculation"]}


class ResponseWriter:
    """One response's output items and stream events, from the chat path's Output deltas.

    `opening()`, then `push(text)` per chunk, then `finish(stats)`; each returns the events to
    send (dicts with `type` and `sequence_number`). `response` is the Response object.
    """

    def __init__(self, response: dict[str, Any], plan: tools.ToolPlan | None) -> None:
        self.response = response
        self.output = tools.output(plan)
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the item being written

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(i) for i in self.response["output"]]}

    def opening(self) -> list[dict[str, Any]]:
        events = [self._event("response.created", response=self._snapshot()),
                  self._event("response.in_progress", response=self._snapshot())]
        return events + self._deltas([self.output.opening()])

    def push(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.output.push(text))

    def finish(self, stats) -> list[dict[str, Any]]:
        events = self._deltas(self.output.finish())
        reason = FINISH_REASONS.get(stats.finish_reason, stats.finish_reason)
        status = "completed" if reason == "stop" else "incomplete"
        events += self._close(status)
        self.response.update(status=status, usage=response_usage(stats), incomplete_details=(
            None if status == "completed" else
            {"reason": "max_output_tokens" if reason == "length" else "max_target_passes"}))
        return events + [self._event(f"response.{status}", response=self._snapshot())]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.response["output"]) - 1}

    def _deltas(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        for delta in deltas:
            if delta.get("content"):
                if self.item is None or self.item["type"] != "message":
                    events += self._close("completed") + self._open({
                        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []})
                    events.append(self._event("response.content_part.added", **self._where(),
                                              content_index=0, part=_part("")))
                self.item["text"] += delta["content"]
                events.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                          delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or ():
                function = call.get("function", {})
                if call.get("id"):
                    events += self._close("completed") + self._open({
                        "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                        "call_id": call["id"], "name": function["name"], "arguments": ""})
                if function.get("arguments"):
                    self.item["arguments"] += function["arguments"]
                    events.append(self._event("response.function_call_arguments.delta", **self._where(),
                                              delta=function["arguments"]))
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.item = {**item, "text": ""} if item["type"] == "message" else item
        self.response["output"].append(item)
        return [self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                            item=dict(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The events that end the open item (none open: none), which gets `status`."""
        item, self.item = self.item, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.response["output"]) - 1}
        if item["type"] == "message":
            text = item.pop("text")
            done = {**item, "status": status, "content": [_part(text)]}
            events = [self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=_part(text))]
        else:
            done = {**item, "status": status}
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        self.response["output"][-1] = done
        return events + [self._event("response.output_item.done", output_index=where["output_index"],
                                     item=done)]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_message(response: dict[str, Any]) -> dict[str, Any]:
    """The response's output as the chat message a later turn's history holds (what chat
    completions' message would be: content, and tool_calls)."""
    text = "".join(p["text"] for item in response["output"] if item["type"] == "message"
                   for p in item["content"])
    calls = [tools.call(i["name"], i["arguments"], i["call_id"]) for i in response["output"]
             if i["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

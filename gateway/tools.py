"""Tool calling: OpenAI's `tools` and `tool_choice` in, an assistant's `tool_calls` out.

- `tool_choice` "required" or a named function: the call is generated under a JSON Schema, on
  the grammar path of response_format json_schema, so it always parses and validates. A named
  function (or the only one) is generated as its arguments alone, under its `parameters`, and
  streams as OpenAI streams arguments; with several functions, "required" generates
  {"name", "arguments"} under the schema of any one of them. One call per choice.
- "auto" (the default when tools are given): the tools go to the chat template and the calls
  are parsed out of the text in the template's format (Orchestrator.GetServedModel's
  tool_call_format: <tool_call> tags, or a bare JSON object); text that is no call stays the
  message's content. A template that takes no tools is a 400: the model would never see them.
- "none": the tools are not shown to the model; plain text.
Every call is exact under speculation like any constrained or free-text request: the target's
tokens, whatever was drafted.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError, invalid

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools are served (None from `plan`: no tools, or tool_choice none)."""

    tools: tuple[dict[str, Any], ...]  # OpenAI tool definitions
    forced: bool  # "required" or a named function: generated under `schema`
    name: str | None = None  # forced, one function: its name (the output is its arguments)
    schema: dict[str, Any] | None = None
    format: str = ""  # auto: the template's tool-call format ("hermes" or "json")

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def plan(request, tool_format: str | None) -> ToolPlan | None:
    """The request's ToolPlan; a 400 where its tool_choice cannot be served.
    `tool_format` is the template's (None: not known, the orchestrator has not said)."""
    if not request.tools:
        if request.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice: requires tools", param="tool_choice")
        return None
    tools = tuple(t.model_dump(exclude_none=True) for t in request.tools)
    choice = request.tool_choice or "auto"
    if choice == "none":
        return None
    if choice == "auto":
        if tool_format is None:
            raise APIError(503, "tool_choice: the orchestrator has not said what its chat template "
                                "supports yet (is it up?)", param="tool_choice", code="unavailable")
        if not tool_format:
            raise invalid("tool_choice: \"auto\" is not supported by this model: its chat template "
                          "takes no tools (no tool support), so the model would never see them; use "
                          "tool_choice \"required\" or a named function (generated under the function's "
                          "JSON Schema)", param="tool_choice", code="unsupported_parameter")
        return ToolPlan(tools, forced=False, format=tool_format)
    return _forced(request, tools, choice)


def _forced(request, tools: tuple[dict[str, Any], ...], choice) -> ToolPlan:
    if getattr(request, "response_format", None) is not None and request.response_format.type != "text" \
            or request.constraint is not None:
        raise invalid("tool_choice: a forced tool call is generated under its own schema; not with "
                      "response_format or constraint", param="tool_choice")
    by_name = {t["function"]["name"]: t for t in tools}
    if choice != "required":
        if choice.function.name not in by_name:
            raise invalid(f"tool_choice: no tool named {choice.function.name!r} in tools",
                          param="tool_choice")
        chosen = [by_name[choice.function.name]]
    else:
        chosen = list(by_name.values())
    if len(chosen) == 1:
        name = chosen[0]["function"]["name"]
        return ToolPlan(tools, forced=True, name=name, schema=_parameters(chosen[0]))
    return ToolPlan(tools, forced=True, schema={"anyOf": [{
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
    } for t in chosen]})


def options(plan: ToolPlan | None) -> dict[str, Any]:
    """client.build_request keywords: the tools for the template, and a forced call's schema."""
    if plan is None:
        return {}
    return {"tools": list(plan.tools), **({"json_schema": plan.schema} if plan.forced else {})}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def call(name: str, arguments: str, ident: str | None = None) -> dict[str, Any]:
    return {"id": ident or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole generated text under `plan`."""
    if plan.forced and plan.name is not None:
        return None, [call(plan.name, text)]
    if plan.forced:
        found = _named(_loads(text), plan.names)
        return (None, found) if found else (text, [])
    if plan.format == "hermes":
        head = text.split(TAG_OPEN, 1)[0]
        found = [c for block in _TAGGED.findall(text) for c in _named(_loads(block), plan.names)]
        if found and len(found) == text.count(TAG_OPEN):
            return head if head.strip() else None, found
        return text, []
    found = _named(_loads(text.strip()), plan.names)
    return (None, found) if found else (text, [])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _named(value: Any, names: set[str]) -> list[dict[str, Any]]:
    """Calls from {"name", "arguments" | "parameters"} objects (or a list of them) naming a tool."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(call(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return calls


class Output:
    """One choice's streamed deltas: plain text (this class), or tool calls (the subclasses).
    `push` takes a text piece, `finish` ends the choice; each returns the deltas to send."""

    def opening(self) -> dict[str, Any]:
        return {"role": "assistant", "content": ""}

    def push(self, text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        return []

    def finish_reason(self, reason: str) -> str:
        return reason


class ArgumentsOut(Output):
    """A forced call of one function: its id and name first, then the arguments as they come."""

    def __init__(self, name: str) -> None:
        self.call = call(name, "")

    def opening(self) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **self.call}]}

    def push(self, text: str) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" else reason


class ParsedOut(Output):
    """Calls parsed at the end. Auto with tags: text before a <tool_call> streams as content
    (held back while it could begin one); a bare-JSON format or a forced choice holds it all."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.calls: list[dict[str, Any]] = []
        self.streams = not plan.forced and plan.format == "hermes"
        self.inside = False  # a tool call began: everything after it is held
        self.sent = False  # some content went out

    def push(self, text: str) -> list[dict[str, Any]]:
        self.held += text
        if not self.streams or self.inside:
            return []
        at = self.held.find(TAG_OPEN)
        if at >= 0:
            self.inside = True
        else:  # hold back what could begin a tag
            at = len(self.held) - next((n for n in range(min(len(TAG_OPEN) - 1, len(self.held)), 0, -1)
                                        if self.held.endswith(TAG_OPEN[:n])), 0)
        out = self.held[:at]
        if not self.sent and not out.strip():
            return []  # blank text before a call is no content: wait for words
        self.held, self.sent = self.held[at:], True
        return [{"content": out}] if out else []

    def finish(self) -> list[dict[str, Any]]:
        content, self.calls = parse(self.plan, self.held)
        if not self.calls:
            return [{"content": content}] if content else []
        return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(self.calls)]

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason


def output(plan: ToolPlan | None) -> Output:
    if plan is None:
        return Output()
    return ArgumentsOut(plan.name) if plan.forced and plan.name is not None else ParsedOut(plan)


def message(plan: ToolPlan | None, text: str) -> dict[str, Any]:
    """The non-streamed choice's message."""
    if plan is None:
        return {"role": "assistant", "content": text, "refusal": None}
    content, calls = parse(plan, text)
    out = {"role": "assistant", "content": content, "refusal": None}
    return {**out, "tool_calls": calls} if calls else {**out, "content": text}


def finish_reason(plan: ToolPlan | None, text: str, reason: str) -> str:
    if plan is None or reason != "stop":
        return reason
    return "tool_calls" if parse(plan, text)[1] else reason

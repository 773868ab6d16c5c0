"""A request's chat messages and tool definitions, as the chat template reads them.

The wire carries an assistant's tool calls and the tool definitions as JSON text
(orchestrator.proto ChatMessage.tool_calls, GenerateRequest.tools); here they become
the lists and dicts Hugging Face chat templates expect: a call's `arguments` as an
object where it parses as one (templates serialise it themselves).
"""
from __future__ import annotations

import json
from typing import Any

from specdec.runtime.errors import InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb


def messages(request: pb.GenerateRequest | pb.CheckRequest) -> list[dict[str, Any]]:
    """Every message as a dict: role and content, and the tool fields it has."""
    return [_message(i, m) for i, m in enumerate(request.messages)]


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = _tool_calls(i, m.tool_calls)
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _tool_calls(i: int, text: str) -> list[dict[str, Any]]:
    field = f"messages[{i}].tool_calls"
    calls = _json(field, text)
    if not isinstance(calls, list):
        raise InvalidArgument(f"{field}: must be a JSON array of calls")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(f"{field}: each call needs function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # not JSON: the template gets the text as it came
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def tools(request: pb.GenerateRequest | pb.CheckRequest) -> list[dict[str, Any]] | None:
    """GenerateRequest.tools as a list of OpenAI tool definitions (None: no tools)."""
    text = getattr(request, "tools", "")
    if not text:
        return None
    defined = _json("tools", text)
    if not isinstance(defined, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in defined):
        raise InvalidArgument("tools: must be a JSON array of {\"type\": \"function\", "
                              "\"function\": {\"name\", ...}}")
    return defined or None


def text_bytes(request: pb.GenerateRequest | pb.CheckRequest) -> int:
    """UTF-8 bytes of the tool fields (part of a request's size, checked before any parsing)."""
    size = len(getattr(request, "tools", "").encode())
    return size + sum(len(m.tool_calls.encode()) + len(m.tool_call_id.encode()) + len(m.name.encode())
                      for m in request.messages)


def _json(field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{field}: not valid JSON: {exc}") from None

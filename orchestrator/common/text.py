"""Text in and out with the target's tokenizer: prompts, chat templates, streamed deltas."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.runtime.errors import InvalidArgument

REPLACEMENT = "\ufffd"


def load_tokenizer(folder: str | None) -> tuple[Any, str]:
    """(tokenizer, folder): `folder`, or the embedded default target's cached folder."""
    from transformers import AutoTokenizer

    from engine.model.loader import resolve

    path, _ = resolve(folder)
    return AutoTokenizer.from_pretrained(path), str(path)


Message = tuple[str, str] | Mapping[str, Any]  # (role, content), or a dict the template reads


def encode_prompt(tokenizer: Any, prompt: str, messages: Sequence[Message],
                  tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of a raw prompt, or of chat messages rendered with the chat template.

    A message is (role, content) or a dict (an assistant's `tool_calls`, a tool result's
    `tool_call_id`); `tools` (OpenAI's definitions) go to templates that take them.
    """
    if prompt and messages:
        raise InvalidArgument("prompt and messages: set exactly one, not both")
    if messages:
        return _encode_chat(tokenizer, [_as_dict(i, m) for i, m in enumerate(messages)], tools)
    if tools:
        raise InvalidArgument("tools: only with messages (a chat template renders them)")
    if not prompt:
        raise InvalidArgument("prompt: must not be empty (or send messages)")
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def _as_dict(i: int, message: Message) -> dict[str, Any]:
    out = dict(message) if isinstance(message, Mapping) else {"role": message[0], "content": message[1]}
    if not out.get("role"):
        raise InvalidArgument(f"messages[{i}].role: must not be empty")
    return out


def _encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("messages: the target's tokenizer has no chat template; send a prompt")
    if not tool_call_format(tokenizer):
        tools = None  # a template without tools: as without them (ServedModel.tool_call_format)
        messages = [_plain(m) for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None,
                                                 tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template rejects these messages (e.g. a role)
        raise InvalidArgument("messages: the target's chat template rejects them (check the "
                              "roles and their order)", detail=str(exc)) from None
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that knows no tool calls: an assistant's calls as JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message.get("content") or ""}
    text = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     for c in calls)
    content = message.get("content") or ""
    return {"role": message["role"], "content": f"{content}\n{text}" if content else text}


def tool_call_format(tokenizer: Any) -> str:
    """How the chat template asks for tool calls: "hermes" (<tool_call> tags), "json" (a bare
    object), "" (the template reads no `tools`)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not _reads_tools(template):
        return ""
    return "hermes" if "<tool_call>" in template else "json"


@functools.lru_cache(maxsize=8)  # parsed once per template, not per request
def _reads_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class IncrementalDecoder:
    """Turns committed token ids into text deltas as they arrive.

    Decodes a short window of recent tokens rather than the whole output, and
    holds text back while the window ends in an incomplete UTF-8 sequence (the
    decoder shows it as U+FFFD), so a multi-byte character split across tokens
    is emitted once, whole. The deltas concatenate to the decode of all ids.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = (), *, keep_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = not keep_special  # special tokens' text (vLLM's skip_special_tokens)
        # A fast tokenizer's own decoder, without the wrapper's argument handling: what its
        # decode runs when no clean-up is asked (every round of every stream decodes twice).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if callable(getattr(backend, "decode", None)) else None
        # A few context tokens so a leading space or merge decodes as in the full text.
        self._ids: list[int] = list(context[-4:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # end of the text already emitted

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        done = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if full.endswith(REPLACEMENT) or len(full) < len(done):
            return ""  # an incomplete character: wait for its remaining bytes
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done) :]

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete sequence decodes as U+FFFD)."""
        done = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(done) :]

"""Text in and out with the target's tokenizer: prompts, chat templates, streamed deltas."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.runtime.errors import InvalidArgument

REPLACEMENT = "\ufffd"


def load_tokenizer(folder: str | None) -> tuple[Any, str]:
    """(tokenizer, folder): `folder`, or the embedded default target's cached folder."""
    from transformers import AutoTokenizer

    from engine.model.loader import resolve

    path, _ = resolve(folder)
    return AutoTokenizer.from_pretrained(path), str(path)


def encode_prompt(tokenizer: Any, prompt: str, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of a raw prompt, or of chat messages rendered with the chat template."""
    if prompt and messages:
        raise InvalidArgument("prompt and messages: set exactly one, not both")
    if messages:
        for i, (role, content) in enumerate(messages):
            if not role:
                raise InvalidArgument(f"messages[{i}].role: must not be empty")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("messages: the target's tokenizer has no chat template; send a prompt")
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:  # noqa: BLE001 - the template rejects these messages (e.g. a role)
            raise InvalidArgument("messages: the target's chat template rejects them (check the "
                                  "roles and their order)", detail=str(exc)) from None
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    if not prompt:
        raise InvalidArgument("prompt: must not be empty (or send messages)")
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class IncrementalDecoder:
    """Turns committed token ids into text deltas as they arrive.

    Decodes a short window of recent tokens rather than the whole output, and
    holds text back while the window ends in an incomplete UTF-8 sequence (the
    decoder shows it as U+FFFD), so a multi-byte character split across tokens
    is emitted once, whole. The deltas concatenate to the decode of all ids.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
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
            return self._backend.decode(ids, skip_special_tokens=True)
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

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

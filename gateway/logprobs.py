"""The OpenAI `logprobs` objects from the orchestrator's TokenLogprob entries.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}`.
Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}`. A log-probability of -inf (a token the grammar or the truncation excludes) is
sent as -9999.0, as the OpenAI API does, since JSON has no infinity.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def _token(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def chat(entries: Sequence[Any]) -> dict[str, Any] | None:
    """The chat choice's `logprobs` (None when the request asked for none)."""
    if not entries:
        return None
    return {"content": [{
        "token": _token(e.token_bytes), "logprob": _value(e.logprob), "bytes": list(e.token_bytes),
        "top_logprobs": [{"token": _token(b), "logprob": _value(v), "bytes": list(b)}
                         for b, v in zip(e.top_bytes, e.top_logprobs)],
    } for e in entries], "refusal": None}


def completion(entries: Sequence[Any], offset: int = 0) -> dict[str, Any] | None:
    """The completion choice's `logprobs`; `offset` is the text offset of the first token."""
    if not entries:
        return None
    tokens, offsets, at = [], [], offset
    for e in entries:
        tokens.append(_token(e.token_bytes))
        offsets.append(at)
        at += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_value(e.logprob) for e in entries],
            "top_logprobs": [{_token(b): _value(v) for b, v in zip(e.top_bytes, e.top_logprobs)}
                             for e in entries] if any(e.top_ids for e in entries) else None,
            "text_offset": offsets}

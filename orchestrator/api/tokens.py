"""Tokenize and Detokenize: the target's tokenizer and chat template, as Generate uses them.

A prompt or chat messages become exactly the token ids a Generate call's prompt holds
(orchestrator.common.text.encode_prompt); `add_special_tokens` adds the tokenizer's own
specials around a prompt, which Generate never does. No model work and no session.
"""
from __future__ import annotations

from typing import Any

from orchestrator.api import chat
from orchestrator.common.text import encode_prompt
from specdec.runtime.errors import InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb

MAX_DETOKENIZE = 1 << 20  # token ids in one Detokenize call


def tokenize(tokenizer: Any, request: pb.TokenizeRequest, context_length: int) -> pb.TokenizeResponse:
    if request.add_special_tokens and request.prompt and not request.messages:
        ids = list(tokenizer.encode(request.prompt, add_special_tokens=True))
    else:
        ids = encode_prompt(tokenizer, request.prompt, chat.messages(request), chat.tools(request))
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else []
    return pb.TokenizeResponse(token_ids=ids, token_strs=strs, context_length=context_length)


def detokenize(tokenizer: Any, request: pb.DetokenizeRequest, vocab_size: int) -> pb.DetokenizeResponse:
    ids = list(request.token_ids)
    if len(ids) > MAX_DETOKENIZE:
        raise InvalidArgument(f"token_ids: at most {MAX_DETOKENIZE} per call")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token_ids: {bad} is outside the vocabulary [0, {vocab_size})")
    return pb.DetokenizeResponse(text=tokenizer.decode(ids, skip_special_tokens=False))

"""POST /tokenize and /detokenize, as vLLM serves them: the orchestrator's tokenizer and chat
template (Orchestrator.Tokenize / Detokenize), so the counts are a generation's own."""
from __future__ import annotations

import grpc
from fastapi import APIRouter, Request

from client import build_tokenize_request
from gateway import state
from gateway.errors import from_rpc_error, invalid
from gateway.generation import body, metadata
from gateway.protocol import DetokenizeRequest, TokenizeRequest, chat_messages, validate
from gateway.schemas import Detokenized, Tokenized, request_body, responses

router = APIRouter()
_ERRORS = {k: v for k, v in responses(Tokenized, Tokenized).items() if k != 200}


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
             responses={200: {"model": Tokenized}, **_ERRORS})
async def tokenize(request: Request) -> dict:
    gw = state.of(request)
    req = validate(TokenizeRequest, await body(request))
    if (req.prompt is None) == (req.messages is None):
        raise invalid("give exactly one of prompt, messages", param="prompt")
    if req.tools and req.messages is None:
        raise invalid("tools: only with messages", param="tools")
    if req.add_special_tokens and req.messages is not None:
        raise invalid("add_special_tokens: only with a prompt (a chat template writes its own)",
                      param="add_special_tokens")
    _check_model(gw, req.model)
    message = build_tokenize_request(
        req.prompt, messages=chat_messages(req) if req.messages is not None else None,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
        add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs)
    reply = await _call(gw.client.tokenize(message, metadata=metadata(request)), "prompt")
    return {"count": len(reply.token_ids), "max_model_len": reply.context_length,
            "tokens": list(reply.token_ids),
            "token_strs": list(reply.token_strs) if req.return_token_strs else None}


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
             responses={200: {"model": Detokenized}, **_ERRORS})
async def detokenize(request: Request) -> dict:
    gw = state.of(request)
    req = validate(DetokenizeRequest, await body(request))
    _check_model(gw, req.model)
    text = await _call(gw.client.detokenize(req.tokens, metadata=metadata(request)), "tokens")
    return {"prompt": text}


def _check_model(gw, model: str | None) -> None:
    if model is not None:
        gw.served.check(model)


async def _call(call, prompt_param: str):
    try:
        return await call
    except grpc.RpcError as exc:
        err = from_rpc_error(exc, prompt_param)
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and err.param is None:
            err.param = prompt_param
        raise err from None

"""What every generating route shares: the body, the caller's token, one Generate stream opened
so that a rejected request gets its HTTP status, a client that leaves cancelling it, and a whole
(not streamed) generation collected.

The route waits for the stream's first chunk before answering, so a request the orchestrator
rejects gets its HTTP status and an OpenAI error body, streaming or not. A client that
disconnects cancels the gRPC call, and the orchestrator frees the session's KV on both
services: mid-stream (the SSE response notices), or before a response that is not streamed
(`unless_disconnected` watches the connection while it waits: uvicorn does not cancel a
handler whose client left).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

import grpc
from fastapi import Request
from starlette.responses import Response

from gateway import tools
from gateway.chunks import DISCONNECTS
from gateway.errors import from_rpc_error, invalid
from gateway.protocol import ChatRequest, CompletionRequest, chat_messages, completion_prompt, generate_options

Metadata = tuple[tuple[str, str], ...] | None


def metadata(request: Request) -> Metadata:
    """The caller's bearer token, passed on to the orchestrator (which decides the tenant)."""
    auth = request.headers.get("authorization")
    return (("authorization", auth),) if auth else None


async def call_options(gw, req: ChatRequest | CompletionRequest,
                       metadata: Metadata) -> tuple[dict, tools.ToolPlan | None]:
    """`AsyncClient.generate`'s keywords for a parsed chat or completion request, and a chat
    request's tool plan; the model id checked (gw: the app's gateway.state.Gateway)."""
    chat = isinstance(req, ChatRequest)
    options = generate_options(req, gw.settings.default_max_tokens)
    info = await gw.served.learn(gw.channel, metadata)
    plan = tools.plan(req, info.tool_call_format if info is not None else None) if chat else None
    options.update(tools.options(plan))
    if chat:
        options["messages"] = chat_messages(req)
    else:
        options["prompt"] = completion_prompt(req)
    gw.served.check(req.model)
    if not getattr(req, "stream", False):
        _check_whole_size(options, gw.settings.max_whole_response_bytes)
    return options, plan


# A token's share of a whole (not streamed) response: its text and, with log-probabilities,
# an entry per alternative (the JSON of a token, its bytes and its logprob), as an upper bound.
BYTES_PER_ENTRY = 64


def _check_whole_size(options: dict, cap: int) -> None:
    """A response that is not streamed is built whole in memory: refuse one whose worst case
    (n x max_tokens x (1 + top_logprobs) entries) is past --max-whole-response-bytes."""
    entries = int(options.get("n") or 1) * int(options.get("max_new_tokens") or 0) * \
        (1 + int(options.get("top_logprobs") or 0) if options.get("logprobs") else 1)
    worst = entries * BYTES_PER_ENTRY
    if cap and worst > cap:
        raise invalid(f"the response could be {worst / 2**20:.0f} MiB (n x max_tokens x (1 + top_logprobs) "
                      f"= {entries} entries), above this gateway's {cap / 2**20:.0f} MiB for a response "
                      "that is not streamed (--max-whole-response-bytes); set stream: true, or ask for less",
                      param="stream", code="response_too_large")


async def body(request: Request):
    """The request's JSON; a 400 where it is not JSON or holds what protobuf cannot encode."""
    try:
        value = await request.json()
        # "\ud800" is valid JSON but no UTF-8 string: protobuf could not encode it.
        json.dumps(value, ensure_ascii=False).encode()
        return value
    except UnicodeEncodeError:
        raise invalid("the request body holds an unpaired UTF-16 surrogate escape",
                      code="invalid_json") from None
    except ValueError:
        raise invalid("the request body is not valid JSON", code="invalid_json") from None


async def unless_disconnected(request: Request, stream, work: Awaitable):
    """`work`'s result; cancelled with the gRPC stream (the generation) if the HTTP client
    disconnects first, and then an empty 499 that nobody reads."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        left = not task.done()  # the client left, or this handler is being cancelled
        if left:
            task.cancel()
            stream.cancel()
    if left:
        await asyncio.gather(task, return_exceptions=True)  # its own clean-up
        DISCONNECTS.inc()
        return Response(status_code=499)
    return task.result()


async def _disconnect(request: Request) -> None:
    """Until the HTTP client disconnects (its body was read: the next ASGI message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # a server that sends something else: do not spin


async def collect(first, events: AsyncIterator, stream, n: int,
                  prompt_param: str) -> tuple[list[str], list[list]]:
    """Each choice's whole text and log-probability entries (a response that is not streamed)."""
    texts: list[list[str]] = [[] for _ in range(n)]
    entries: list[list] = [[] for _ in range(n)]
    if first is not None:
        texts[first.index].append(first.text)
        entries[first.index].extend(first.logprobs)
    try:
        async for chunk in events:
            texts[chunk.index].append(chunk.text)
            entries[chunk.index].extend(chunk.logprobs)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, prompt_param) from None
    finally:
        stream.cancel()  # a no-op once finished; frees the session if we were cancelled
    return ["".join(t) for t in texts], entries

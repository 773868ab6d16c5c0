"""The `data:` events of one streamed generation, as OpenAI streams them.

With n > 1 the choices' chunks interleave, each with its `index`; a choice's finish chunk goes
out as soon as its Stats has come. Plain text chunks are precomputed JSON with the text spliced
in; a chat choice with tool calls streams the deltas of its gateway.tools.Output. With
stream_options include_usage the last event carries the usage, and with continuous_usage_stats
too every chunk carries the counts so far (vLLM's extension).
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter

from gateway import logprobs, tools
from gateway.errors import APIError, from_rpc_error
from gateway.protocol import FINISH_REASONS, usage, usage_so_far

_TEXT = "\x00specdec-text\x00"  # placeholder split out of the precomputed chunk JSON

DISCONNECTS = Counter("specdec_http_stream_disconnects_total",
                      "Streams the HTTP client left before the end (generation cancelled)")


class Chunks:
    """The JSON of one streamed generation's chunks."""

    def __init__(self, ident: str, chat: bool, n: int, model: str, *, include_usage: bool,
                 continuous: bool = False, plan: tools.ToolPlan | None = None, prompt_tokens: int = 0) -> None:
        self.chat, self.n, self.include_usage, self.continuous = chat, n, include_usage, continuous
        self.base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model, "system_fingerprint": None}
        if include_usage:
            self.base["usage"] = None
        self.outputs = [tools.output(plan if chat else None) for _ in range(n)]
        self.plain = plan is None or not chat
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        # Text chunks are the precomputed JSON with the text spliced in.
        self.spliced = [self.chunk(i, {"content": _TEXT} if chat else _TEXT).split(json.dumps(_TEXT))
                        for i in range(n)]
        self.ended: set[int] = set()
        self.offsets = [0] * n  # completions' text_offset: characters streamed so far per choice

    def chunk(self, index: int, delta_or_text, finish=None, lps=None) -> str:
        if self.chat:
            choice = {"index": index, "delta": delta_or_text, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta_or_text, "logprobs": lps, "finish_reason": finish}
        body = {**self.base, "choices": [choice]}
        if self.continuous:
            body["usage"] = usage_so_far(self.prompt_tokens, self.completion_tokens)
        return json.dumps(body)

    def opening(self) -> list[str]:
        """Chat's first chunk of each choice: the assistant's role (and a forced call's name)."""
        return [self.chunk(i, self.outputs[i].opening()) for i in range(self.n)] if self.chat else []

    def finished(self, stream) -> list[str]:
        """The closing chunks of the choices whose Stats came since the last call."""
        out = []
        for index in sorted(set(stream.choice_stats) - self.ended):
            self.ended.add(index)
            st = stream.choice_stats[index]
            reason = FINISH_REASONS.get(st.finish_reason, st.finish_reason)
            output = self.outputs[index]
            out += [self.chunk(index, delta) for delta in output.finish()] if self.chat else []
            out.append(self.chunk(index, {} if self.chat else "", output.finish_reason(reason)))
        return out

    def text(self, piece) -> list[str]:
        self.completion_tokens += len(piece.token_ids)
        if not self.chat:
            return [self._completion_text(piece)]
        lps = logprobs.chat(piece.logprobs) if piece.logprobs else None
        if self.plain and lps is None and not self.continuous:
            head, tail = self.spliced[piece.index]
            return [head + json.dumps(piece.text) + tail]
        deltas = self.outputs[piece.index].push(piece.text)
        if not deltas and lps is not None:  # an EOS has no text, but its log-probability
            deltas = [{"content": ""} if self.plain else {}]
        return [self.chunk(piece.index, delta, lps=lps if i == 0 else None) for i, delta in enumerate(deltas)]

    def _completion_text(self, piece) -> str:
        if piece.logprobs:  # built whole: the log-probabilities ride along
            line = self.chunk(piece.index, piece.text,
                              lps=logprobs.completion(piece.logprobs, self.offsets[piece.index]))
            self.offsets[piece.index] += len(piece.text)
            return line
        if self.continuous:
            return self.chunk(piece.index, piece.text)
        head, tail = self.spliced[piece.index]
        return head + json.dumps(piece.text) + tail

    def usage(self, stream) -> str:
        return json.dumps({**self.base, "choices": [], "usage": usage(choice_stats(stream, self.n))})


async def sse(chunks: Chunks, first, events: AsyncIterator, stream, prompt_param: str) -> AsyncIterator[str]:
    """`data:` lines of one streamed generation, ending with `[DONE]`."""
    finished = False
    try:
        for line in chunks.opening():
            yield line
        for line in _piece(chunks, first):
            yield line
        async for piece in events:
            for line in chunks.finished(stream):
                yield line
            for line in _piece(chunks, piece):
                yield line
        for line in chunks.finished(stream):
            yield line
        if chunks.include_usage:
            yield chunks.usage(stream)
        yield "[DONE]"
        finished = True
    except grpc.RpcError as exc:
        finished = True
        yield json.dumps(from_rpc_error(exc, prompt_param).body())
    finally:
        if not finished:
            DISCONNECTS.inc()
        # The client went away (this generator is cancelled) or the stream ended:
        # cancelling the call makes the orchestrator release both services' KV.
        stream.cancel()


def _piece(chunks: Chunks, piece) -> list[str]:
    """The lines of one received chunk; one with neither text nor log-probabilities (an EOS)
    sends nothing, but its tokens count."""
    if piece is None:
        return []
    if piece.text or piece.logprobs or (chunks.continuous and piece.token_ids):
        return chunks.text(piece)
    chunks.completion_tokens += len(piece.token_ids)
    return []


def choice_stats(stream, n: int) -> list:
    """The choices' Stats in index order (an orchestrator without n sends one, index 0)."""
    stats = stream.choice_stats
    if sorted(stats) != list(range(n)):
        raise APIError(502, f"the orchestrator sent stats for choices {sorted(stats)} of {n}",
                       code="bad_gateway")
    return [stats[i] for i in range(n)]

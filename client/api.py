"""The specdec client library: talk to an orchestrator over gRPC.

    from client import Client

    with Client("127.0.0.1:50050") as c:
        stream = c.generate("Write a haiku about caches.", max_new_tokens=64)
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print(stream.stats.target_passes)

        done = c.complete("Hello", proposer="lookup")
        print(done.text, done.stats.acceptance_rate)

Against a secured orchestrator: `Client(address, token="...", ca="ca.pem")`
(TLS trusting that CA, and `authorization: Bearer <token>` on every call;
`cert`/`key` add a client certificate for mutual TLS).

`AsyncClient` is the asyncio twin (`async for chunk in c.generate(...)`,
`await c.complete(...)`). Only the proto (specdec.v1) is used: the stats are
the `specdec.v1.Stats` message. Errors are `grpc.RpcError`s with the server's
status code and a message naming the offending field.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from specdec.security import aio_channel, bearer_metadata, channel_credentials, sync_channel
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

ProposerName = Literal["default", "draft", "lookup", "guess", "none"]
_PROPOSERS = {"default": pb.PROPOSER_UNSPECIFIED, "draft": pb.PROPOSER_DRAFT,
              "lookup": pb.PROPOSER_LOOKUP, "guess": pb.PROPOSER_GUESS, "none": pb.PROPOSER_NONE}
Stats = pb.Stats
Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Chunk:
    """Text and token ids committed in one round (stop strings never included)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    stats: pb.Stats

    @property
    def tokens_per_second(self) -> float:
        return self.stats.new_tokens / (self.stats.total_ms / 1e3) if self.stats.total_ms else 0.0


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    proposer: ProposerName = "default",
    k: int = 0,
    guess: str = "",
    session_id: str = "",
    strict: bool = False,
) -> pb.GenerateRequest:
    """A GenerateRequest. Give `prompt` or chat `messages` ({"role", "content"} dicts).

    temperature 0 is greedy; seed 0 lets the server pick one (reported in stats.seed);
    k 0 is the server's default; session_id continues a conversation (send the
    whole conversation again: the shared prefix is served from cache).
    """
    if proposer not in _PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(_PROPOSERS)}, got {proposer!r}")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p)
    if top_p is not None:
        sampling.top_p = top_p
    return pb.GenerateRequest(
        prompt=prompt or "",
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        stop=list(stop),
        proposer=_PROPOSERS[proposer],
        k=k,
        guess=guess,
        session_id=session_id,
        strict=strict,
    )


class Stream:
    """Chunks of one generation as they commit; `stats` is set once it is exhausted."""

    def __init__(self, call: grpc.UnaryStreamMultiCallable, request: pb.GenerateRequest,
                 timeout: float | None, metadata: Metadata | None = None) -> None:
        self._call = call(request, timeout=timeout, metadata=metadata)
        self.stats: pb.Stats | None = None

    def __iter__(self) -> Iterator[Chunk]:
        for response in self._call:
            if response.HasField("chunk"):
                yield Chunk(response.chunk.text, tuple(response.chunk.token_ids))
            else:
                self.stats = response.stats

    def cancel(self) -> None:
        """Stop the generation; the server frees the session's caches."""
        self._call.cancel()


class AsyncStream:
    """The asyncio twin of `Stream`."""

    def __init__(self, call, request: pb.GenerateRequest, timeout: float | None,
                 metadata: Metadata | None = None) -> None:
        self._call = call(request, timeout=timeout, metadata=metadata)
        self.stats: pb.Stats | None = None

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        async for response in self._call:
            if response.HasField("chunk"):
                yield Chunk(response.chunk.text, tuple(response.chunk.token_ids))
            else:
                self.stats = response.stats

    def cancel(self) -> None:
        self._call.cancel()


def _collect(chunks: Sequence[Chunk], stats: pb.Stats | None) -> Completion:
    if stats is None:
        raise RuntimeError("the stream ended without a Stats message")
    return Completion(
        text="".join(c.text for c in chunks),
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        stats=stats,
    )


def _with_token(token: str | None, metadata: Metadata | None) -> Metadata | None:
    """The call's metadata: the caller's, else the client's bearer token."""
    if metadata is not None:
        return metadata
    return bearer_metadata(token) or None


class Client:
    """A blocking client for one orchestrator address.

    `token`: sent as `authorization: Bearer <token>`; `ca`: PEM file of the CA
    that signed the orchestrator's certificate (enables TLS); `cert`/`key`: a
    client certificate for mutual TLS.
    """

    def __init__(self, address: str, *, timeout: float | None = 600.0, token: str | None = None,
                 ca: str | None = None, cert: str | None = None, key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._token = token
        self._channel = sync_channel(address, channel_credentials(ca, cert, key))
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

    def generate(self, prompt: str | None = None, *, metadata: Metadata | None = None,
                 **options) -> Stream:
        """Stream a generation; see `build_request` for the options.

        `metadata` ((key, value) pairs, e.g. ("authorization", "Bearer ...")) goes
        with the call as gRPC metadata.
        """
        return Stream(self._stub.Generate, build_request(prompt, **options), self.timeout,
                      _with_token(self._token, metadata))

    def complete(self, prompt: str | None = None, **options) -> Completion:
        """Generate to the end; the whole text, its token ids and the stats."""
        stream = self.generate(prompt, **options)
        chunks = list(stream)
        return _collect(chunks, stream.stats)

    def check(self, prompt: str, guess: str) -> pb.CheckResponse:
        """Which tokens of `guess` the target accepts after `prompt`, in one target pass."""
        return self._stub.Check(pb.CheckRequest(prompt=prompt, guess=guess), timeout=self.timeout,
                                metadata=_with_token(self._token, None))

    def end_session(self, session_id: str) -> bool:
        """Forget a session (its Redis record and both services' caches)."""
        reply = self._stub.EndSession(pb.EndSessionRequest(session_id=session_id), timeout=self.timeout,
                                      metadata=_with_token(self._token, None))
        return reply.existed

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """An asyncio client for one orchestrator address."""

    def __init__(self, address: str, *, timeout: float | None = 600.0, token: str | None = None,
                 ca: str | None = None, cert: str | None = None, key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._token = token
        self._channel = aio_channel(address, channel_credentials(ca, cert, key))
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

    def generate(self, prompt: str | None = None, *, metadata: Metadata | None = None,
                 **options) -> AsyncStream:
        return AsyncStream(self._stub.Generate, build_request(prompt, **options), self.timeout,
                           _with_token(self._token, metadata))

    async def complete(self, prompt: str | None = None, **options) -> Completion:
        stream = self.generate(prompt, **options)
        chunks = [chunk async for chunk in stream]
        return _collect(chunks, stream.stats)

    async def check(self, prompt: str, guess: str) -> pb.CheckResponse:
        return await self._stub.Check(pb.CheckRequest(prompt=prompt, guess=guess), timeout=self.timeout,
                                      metadata=_with_token(self._token, None))

    async def end_session(self, session_id: str) -> bool:
        reply = await self._stub.EndSession(pb.EndSessionRequest(session_id=session_id),
                                            timeout=self.timeout,
                                            metadata=_with_token(self._token, None))
        return reply.existed

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

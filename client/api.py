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

Give several orchestrator addresses (a list, or one string with commas) and a
stream that breaks with UNAVAILABLE (its orchestrator died, or Redis stayed
down past the server's bound) is resumed on the next address: the request is
sent again with the session id from its first chunk, `resume_from` = the
index after the last token received and the tokens received (`delivered`),
and the turn continues from exactly those tokens: the caller sees one
uninterrupted stream (`retries` bounds the attempts). With `spread=True` the
addresses are peers (orchestrator processes over one fleet, scaled out): each
new stream starts on the next address in turn, and a broken one resumes on the
address after its own. A stream of n > 1
choices resumes each unfinished choice from its own tokens. A request is single-turn unless
`keep_session=True`; then `stats.session_id` continues it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from client.multiplex import Multiplexed
from specdec.runtime.security import aio_channel, bearer_metadata, channel_credentials, sync_channel
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

# "default" (the server's), or any kind the server serves (ServedModel.proposers: "combined",
# "draft", "lookup", "suffix", "none", an installed plugin's...). The client keeps no list.
ProposerName = str
Stats = pb.Stats
Metadata = Sequence[tuple[str, str]]
# A stream broken with these is resumed on the next address: the orchestrator is gone
# (the connection broke) or a dependency stayed down.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
MAX_MUXES = 256  # multiplexed streams' owners kept per client (address, metadata) before idle ones go


@dataclass(frozen=True)
class Chunk:
    """Text and token ids committed in one round (stop strings never included)."""

    text: str
    token_ids: tuple[int, ...]
    start_index: int = 0  # index of token_ids[0] in the session's tokens (the prompt's come first)
    round: pb.RoundTokens | None = None  # with round_tokens=True: what the round drafted and kept
    logprobs: tuple[pb.TokenLogprob, ...] = ()  # with logprobs=True: one per token id
    index: int = 0  # the choice (n > 1)


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    stats: pb.Stats
    logprobs: tuple[pb.TokenLogprob, ...] = ()  # with logprobs=True: one per token id
    choices: tuple[Completion, ...] = ()  # n > 1: every choice's, by index (this is choice 0)

    @property
    def tokens_per_second(self) -> float:
        return self.stats.new_tokens / (self.stats.total_ms / 1e3) if self.stats.total_ms else 0.0


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
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
    keep_session: bool = False,
    parallel: bool | None = None,
    round_tokens: bool = False,
    max_target_passes: int = 0,
    json_schema: str | Mapping[str, Any] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    lark: str | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prediction: str = "",
    n: int = 1,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    skip_special_tokens: bool = True,
    include_stop_str_in_output: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest. Give `prompt` or chat `messages` ({"role", "content"} dicts).

    temperature 0 is greedy; seed 0 lets the server pick one (reported in stats.seed);
    k 0 is the server's default; keep_session=True keeps the session for later
    turns (its id is stats.session_id), session_id continues one (send the whole
    conversation again: the shared prefix is served from cache). parallel=True asks
    for parallel speculation (the draft drafts the next round while the target
    verifies; same text), False for sequential, None for the server's default.
    round_tokens=True makes every chunk carry its round (`Chunk.round`: drafted
    tokens, accepted count, the extra token's kind, the source); max_target_passes
    stops the turn after that many target passes (finish_reason "passes").
    Structured output: at most one of json_schema (a dict or its JSON text),
    json_object, regex or lark; every generated token then follows the grammar.
    logprobs=True makes every chunk carry its tokens' log-probabilities
    (`Chunk.logprobs`), with top_logprobs alternatives each (0..20).
    prediction (Predicted Outputs) is the text most of the answer is expected to be:
    proposed while the output follows it, re-aligned after a rejection (greedy: the same text).
    n > 1 generates n choices (chunks carry `index`; the stream's `choice_stats` has
    each one's Stats); a broken stream resumes every unfinished choice from its own tokens.
    ignore_eos=True generates exactly max_new_tokens (an EOS is streamed like any token; for load tests).
    vLLM's extensions: min_tokens (no EOS or stop token id among the first ones), stop_token_ids
    (end the turn like an EOS), skip_special_tokens, include_stop_str_in_output. tools (OpenAI's
    definitions) go to the chat template; a message may carry `tool_calls`, `tool_call_id`, `name`.
    """
    if not isinstance(proposer, str) or not proposer:
        raise ValueError(f"proposer must be 'default' or a proposer the server serves, got {proposer!r}")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p)
    if top_p is not None:
        sampling.top_p = top_p
    return pb.GenerateRequest(
        prompt=prompt or "",
        messages=[_chat_message(m) for m in messages or ()],
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        stop=list(stop),
        proposer=_wire_proposer(proposer),
        proposer_name="" if proposer == "default" else proposer,
        k=k,
        guess=guess,
        session_id=session_id,
        strict=strict,
        keep_session=keep_session,
        speculation={None: pb.SPECULATION_UNSPECIFIED, False: pb.SPECULATION_SEQUENTIAL,
                     True: pb.SPECULATION_PARALLEL}[parallel],
        round_tokens=round_tokens,
        max_target_passes=max_target_passes,
        constraint=_constraint(json_schema, json_object, regex, lark),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prediction=prediction,
        n=n,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
        keep_special_tokens=not skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
        tools=json.dumps(list(tools)) if tools else "",
    )


def build_tokenize_request(prompt: str | None = None, *, messages: Sequence[Mapping[str, Any]] | None = None,
                           tools: Sequence[Mapping[str, Any]] | None = None, add_special_tokens: bool = False,
                           return_token_strs: bool = False) -> pb.TokenizeRequest:
    """A TokenizeRequest: a prompt, or messages (and tools) as build_request takes them."""
    return pb.TokenizeRequest(prompt=prompt or "", messages=[_chat_message(m) for m in messages or ()],
                              tools=json.dumps(list(tools)) if tools else "",
                              add_special_tokens=add_special_tokens, return_token_strs=return_token_strs)


def _wire_proposer(name: str) -> int:
    """The proto enum's value for a kind that has one (servers that predate proposer_name read
    it), else PROPOSER_UNSPECIFIED: the name alone says it."""
    wire = f"PROPOSER_{name.upper()}"
    return pb.Proposer.Value(wire) if name != "default" and wire in pb.Proposer.keys() else 0


def _chat_message(m: Mapping[str, Any]) -> pb.ChatMessage:
    """{"role", "content"} and, for tool calling, "tool_calls" (a list or its JSON text),
    "tool_call_id" and "name"."""
    calls = m.get("tool_calls") or ""
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "",
                          tool_calls=calls if isinstance(calls, str) else json.dumps(list(calls)),
                          tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")


def _constraint(json_schema, json_object: bool, regex: str | None, lark: str | None) -> pb.Constraint | None:
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object),
                                      ("regex", regex), ("lark", lark)) if value]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, json_object, regex, lark; got {given}")
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema)
    if json_schema:
        return pb.Constraint(json_schema=json_schema)
    if json_object:
        return pb.Constraint(json_object=True)
    if regex:
        return pb.Constraint(regex=regex)
    if lark:
        return pb.Constraint(lark=lark)
    return None


def predict_request(text: str, top_k: int = 0, temperature: float | None = None,
                    distributions: bool = False, sampling_top_k: int = 0) -> pb.PredictRequest:
    """A PredictRequest; temperature None is the model's own softmax (temperature 1).
    `top_k` is how many predictions per position; `sampling_top_k` truncates the
    distributions themselves (as a sampler's top-k would)."""
    request = pb.PredictRequest(text=text, top_k=top_k, distributions=distributions)
    if temperature is not None or sampling_top_k:
        request.sampling.temperature = 1.0 if temperature is None else temperature
        request.sampling.top_k = sampling_top_k
    return request


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """["a:1", "b:2"] from "a:1,b:2", ["a:1", "b:2"] or ["a:1,b:2"]."""
    items = [address] if isinstance(address, str) else list(address)
    addresses = [a.strip() for item in items for a in item.split(",") if a.strip()]
    if not addresses:
        raise ValueError("address: give at least one orchestrator address")
    return addresses


class _Resume:
    """A stream's progress (session id, every choice's tokens received, the choices finished) and
    the request that resumes it from exactly those tokens."""

    def __init__(self, request: pb.GenerateRequest, retries: int) -> None:
        self.request, self.retries = request, retries
        self.session_id, self.next_index, self.failures = request.session_id, 0, 0
        self.delivered: dict[int, list[int]] = {}  # choice -> its generated tokens received
        self.finished: set[int] = set()  # choices whose Stats came

    def chunk(self, c: pb.Chunk) -> Chunk:
        self.session_id = c.session_id or self.session_id
        self.next_index = c.start_index + len(c.token_ids)
        self.delivered.setdefault(c.index, []).extend(c.token_ids)
        return Chunk(c.text, tuple(c.token_ids), c.start_index,
                     c.round if c.HasField("round") else None, tuple(c.logprobs), c.index)

    def stats(self, stats: pb.Stats) -> None:
        self.finished.add(stats.index)

    def again(self, error: grpc.RpcError) -> pb.GenerateRequest | None:
        """The request resuming the stream after `error`, or None when it is not to be retried."""
        if error.code() not in RESUMABLE or self.failures >= self.retries:
            return None
        self.failures += 1
        request = pb.GenerateRequest()
        request.CopyFrom(self.request)
        if self.request.n > 1:  # every choice from its own tokens; no session
            del request.delivered[:]
            request.delivered.extend(
                pb.Delivered(index=i, token_ids=self.delivered.get(i, ()), finished=i in self.finished)
                for i in range(self.request.n))
            return request
        request.session_id = self.session_id  # "" only if no chunk came: then a plain retry
        if self.session_id and self.next_index:
            request.resume_from = self.next_index
            del request.delivered[:]
            request.delivered.append(pb.Delivered(index=0, token_ids=self.delivered.get(0, ())))
        return request

    @property
    def backoff_s(self) -> float:
        return min(0.1 * 2 ** (self.failures - 1), 1.0)


class _Stream:
    """What the blocking and asyncio streams share: the call, its progress, and how it resumes."""

    def __init__(self, client: _Orchestrators, request: pb.GenerateRequest, timeout: float | None,
                 metadata: Metadata | None = None) -> None:
        self._client, self._timeout, self._metadata = client, timeout, metadata
        self._resume = _Resume(request, client.retries)
        self._cancelled = False
        self._at = client._start()  # the address it runs on (its index in client.addresses)
        self._call = client._generate_call(self._at, request, timeout, metadata)
        self.stats: pb.Stats | None = None  # the last Stats (n = 1: the only one)
        self.choice_stats: dict[int, pb.Stats] = {}  # Stats.index -> its Stats (n > 1)

    def _receive(self, response: pb.GenerateResponse) -> Chunk | None:
        if response.HasField("chunk"):
            return self._resume.chunk(response.chunk)
        self.stats = self.choice_stats[response.stats.index] = response.stats
        self._resume.stats(response.stats)
        return None

    def _again(self, error: grpc.RpcError) -> pb.GenerateRequest | None:
        """After a break: the request resuming it, or None (the error stands)."""
        return None if self._cancelled else self._resume.again(error)

    def _restart(self, again: pb.GenerateRequest) -> None:
        """Send the resuming request to the next address."""
        self._at = self._client._next(self._at)
        self._call = self._client._generate_call(self._at, again, self._timeout, self._metadata)

    @property
    def address(self) -> str:
        """The orchestrator address the stream runs on now."""
        return self._client.addresses[self._at % len(self._client.addresses)]

    @property
    def session_id(self) -> str:
        """The stream's session (known from its first chunk on)."""
        return self._resume.session_id

    def cancel(self) -> None:
        """Stop the generation (the session keeps what was committed; see keep_session)."""
        self._cancelled = True
        self._call.cancel()


class Stream(_Stream):
    """Chunks of one generation as they commit; `stats` is set once it is exhausted.

    A break with UNAVAILABLE is resumed on the client's next address (no
    duplicates, no gaps); `cancel()` stops it for good.
    """

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            try:
                for response in self._call:
                    chunk = self._receive(response)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as error:
                again = self._again(error)
                if again is None:
                    raise
                time.sleep(self._resume.backoff_s)
                self._restart(again)


class AsyncStream(_Stream):
    """The asyncio twin of `Stream`."""

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            try:
                async for response in self._call:
                    chunk = self._receive(response)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as error:
                again = self._again(error)
                if again is None:
                    raise
                await asyncio.sleep(self._resume.backoff_s)
                self._restart(again)


def _collect(chunks: Sequence[Chunk], choice_stats: Mapping[int, pb.Stats]) -> Completion:
    """Choice 0's Completion; with n > 1 every choice's is in its `choices`."""
    if 0 not in choice_stats:
        raise RuntimeError("the stream ended without a Stats message")
    choices = tuple(
        Completion(text="".join(c.text for c in chunks if c.index == i),
                   token_ids=tuple(t for c in chunks if c.index == i for t in c.token_ids),
                   stats=choice_stats[i],
                   logprobs=tuple(lp for c in chunks if c.index == i for lp in c.logprobs))
        for i in sorted(choice_stats))
    return choices[0] if len(choices) == 1 else dataclasses.replace(choices[0], choices=choices)


def _with_token(token: str | None, metadata: Metadata | None) -> Metadata | None:
    """The call's metadata: the caller's, else the client's bearer token."""
    if metadata is not None:
        return metadata
    return bearer_metadata(token) or None


class _Orchestrators:
    """The addresses a client talks to, one channel each, and which one is current (the one calls
    other than Generate go to, and without `spread` every new stream)."""

    def __init__(self, address: str | Sequence[str], *, timeout: float | None = 600.0,
                 token: str | None = None, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, retries: int = 3, spread: bool = False) -> None:
        self.addresses = split_addresses(address)
        self.timeout, self.retries, self.spread = timeout, retries, spread
        self._token = token
        self._credentials = channel_credentials(ca, cert, key)
        self._channels: dict[str, Any] = {}
        self._stubs: dict[str, orchestrator_pb2_grpc.OrchestratorStub] = {}
        self._turn = 0  # spread: the address the next stream starts on
        self._use(0)

    def _open(self, address: str) -> Any:
        raise NotImplementedError

    def _stub_at(self, i: int) -> orchestrator_pb2_grpc.OrchestratorStub:
        """Address i's stub (its channel opened once)."""
        address = self.addresses[i % len(self.addresses)]
        if address not in self._channels:
            self._channels[address] = self._open(address)
            self._stubs[address] = orchestrator_pb2_grpc.OrchestratorStub(self._channels[address])
        return self._stubs[address]

    def _generate_call(self, i: int, request: pb.GenerateRequest, timeout: float | None,
                       metadata: Metadata | None) -> Any:
        """A Generate call on address i (an iterable of GenerateResponses, with cancel())."""
        return self._stub_at(i).Generate(request, timeout=timeout, metadata=metadata)

    def _use(self, i: int) -> orchestrator_pb2_grpc.OrchestratorStub:
        """Make address i the current one."""
        self._current = i % len(self.addresses)
        self.address = self.addresses[self._current]
        self._stub = self._stub_at(self._current)
        self._channel = self._channels[self.address]
        return self._stub

    def _start(self) -> int:
        """The address a new stream starts on: the next in turn (spread), else the current one."""
        if not self.spread:
            return self._current
        self._turn += 1
        return (self._turn - 1) % len(self.addresses)

    def _next(self, at: int) -> int:
        """The address a stream broken on address `at` resumes on. Without `spread` it becomes the
        current one (for later calls too)."""
        if self.spread:
            if at % len(self.addresses) == self._current:  # the current one failed: others' calls move on
                self._use(self._current + 1)
            return (at + 1) % len(self.addresses)
        self._use(self._current + 1)
        return self._current

    @property
    def channel(self) -> Any:
        """The current address's channel (for other services on it: health, reflection)."""
        return self._channel


class Client(_Orchestrators):
    """A blocking client for one or more orchestrator addresses (a stream resumes on the next).

    `address`: "host:port", several comma-separated, or a list; `retries`: how
    many times a broken stream is resumed; `spread`: the addresses are peers, each
    new stream starts on the next one in turn (else every stream goes to the
    current one, the next taking over when it fails). `token`: sent as `authorization:
    Bearer <token>`; `ca`: PEM file of the CA that signed the orchestrator's
    certificate (enables TLS); `cert`/`key`: a client certificate for mutual TLS.
    """

    def _open(self, address: str) -> grpc.Channel:
        return sync_channel(address, self._credentials)

    def generate(self, prompt: str | None = None, *, metadata: Metadata | None = None,
                 **options) -> Stream:
        """Stream a generation; see `build_request` for the options.

        `metadata` ((key, value) pairs, e.g. ("authorization", "Bearer ...")) goes
        with the call as gRPC metadata.
        """
        return Stream(self, build_request(prompt, **options), self.timeout,
                      _with_token(self._token, metadata))

    def complete(self, prompt: str | None = None, **options) -> Completion:
        """Generate to the end; the whole text, its token ids and the stats (n > 1: choice
        0's, every choice in `choices`)."""
        stream = self.generate(prompt, **options)
        chunks = list(stream)
        return _collect(chunks, stream.choice_stats)

    def check(self, prompt: str, guess: str) -> pb.CheckResponse:
        """Which tokens of `guess` the target accepts after `prompt`, in one target pass."""
        return self._stub.Check(pb.CheckRequest(prompt=prompt, guess=guess), timeout=self.timeout,
                                metadata=_with_token(self._token, None))

    def predict(self, text: str, *, top_k: int = 0, temperature: float | None = None,
                distributions: bool = False, sampling_top_k: int = 0) -> pb.PredictResponse:
        """The target's top_k predictions at every position of `text`, in one target pass
        (with `distributions`: also p and q after it)."""
        return self._stub.Predict(predict_request(text, top_k, temperature, distributions,
                                                  sampling_top_k),
                                  timeout=self.timeout, metadata=_with_token(self._token, None))

    def served_model(self) -> pb.ServedModel:
        """What the orchestrator serves: its model's name and context, and the proposers a request
        may name (`proposers`, the default first)."""
        return self._stub.GetServedModel(pb.GetServedModelRequest(), timeout=self.timeout,
                                         metadata=_with_token(self._token, None))

    def end_session(self, session_id: str) -> bool:
        """Forget a session (its Redis record and both services' caches)."""
        reply = self._stub.EndSession(pb.EndSessionRequest(session_id=session_id), timeout=self.timeout,
                                      metadata=_with_token(self._token, None))
        return reply.existed

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Orchestrators):
    """An asyncio client for one or more orchestrator addresses (the options are Client's).

    `multiplex=True` runs every generation to one address over one shared GenerateMany stream
    (client.multiplex): the orchestrator sends the chunks of all of them that commit together as
    one message, which costs both sides far less than a message per stream at many streams.
    Generations resume after a break exactly as Generate streams do.
    """

    def __init__(self, address: str | Sequence[str], *, multiplex: bool = False, **options) -> None:
        super().__init__(address, **options)
        self.multiplex = multiplex
        self._muxes: dict[tuple[str, tuple], Multiplexed] = {}

    def _open(self, address: str) -> grpc.aio.Channel:
        return aio_channel(address, self._credentials)

    def _generate_call(self, i: int, request: pb.GenerateRequest, timeout: float | None,
                       metadata: Metadata | None) -> Any:
        if not self.multiplex:
            return super()._generate_call(i, request, timeout, metadata)
        self._stub_at(i)  # its channel
        address = self.addresses[i % len(self.addresses)]
        key = (address, tuple(metadata or ()))
        if key not in self._muxes:
            if len(self._muxes) >= MAX_MUXES:  # one per caller's token (a gateway): drop the idle ones
                self._muxes = {k: m for k, m in self._muxes.items() if not m.idle}
            self._muxes[key] = Multiplexed(self._channels[address], metadata)
        return self._muxes[key].generate(request, timeout)

    def generate(self, prompt: str | None = None, *, metadata: Metadata | None = None,
                 **options) -> AsyncStream:
        return AsyncStream(self, build_request(prompt, **options), self.timeout,
                           _with_token(self._token, metadata))

    async def complete(self, prompt: str | None = None, **options) -> Completion:
        stream = self.generate(prompt, **options)
        chunks = [chunk async for chunk in stream]
        return _collect(chunks, stream.choice_stats)

    async def check(self, prompt: str, guess: str) -> pb.CheckResponse:
        return await self._stub.Check(pb.CheckRequest(prompt=prompt, guess=guess), timeout=self.timeout,
                                      metadata=_with_token(self._token, None))

    async def predict(self, text: str, *, top_k: int = 0, temperature: float | None = None,
                      distributions: bool = False, sampling_top_k: int = 0) -> pb.PredictResponse:
        return await self._stub.Predict(predict_request(text, top_k, temperature, distributions,
                                                  sampling_top_k),
                                        timeout=self.timeout, metadata=_with_token(self._token, None))

    async def served_model(self, *, metadata: Metadata | None = None) -> pb.ServedModel:
        """As Client.served_model."""
        return await self._stub.GetServedModel(pb.GetServedModelRequest(), timeout=self.timeout,
                                               metadata=_with_token(self._token, metadata))

    async def end_session(self, session_id: str, *, metadata: Metadata | None = None) -> bool:
        reply = await self._stub.EndSession(pb.EndSessionRequest(session_id=session_id),
                                            timeout=self.timeout,
                                            metadata=_with_token(self._token, metadata))
        return reply.existed

    async def tokenize(self, request: pb.TokenizeRequest, *,
                       metadata: Metadata | None = None) -> pb.TokenizeResponse:
        """The target's token ids (build_tokenize_request makes the request)."""
        return await self._stub.Tokenize(request, timeout=self.timeout,
                                         metadata=_with_token(self._token, metadata))

    async def detokenize(self, token_ids: Sequence[int], *,
                         metadata: Metadata | None = None) -> str:
        reply = await self._stub.Detokenize(pb.DetokenizeRequest(token_ids=list(token_ids)),
                                            timeout=self.timeout,
                                            metadata=_with_token(self._token, metadata))
        return reply.text

    async def close(self) -> None:
        for mux in self._muxes.values():
            await mux.close()
        for channel in self._channels.values():
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

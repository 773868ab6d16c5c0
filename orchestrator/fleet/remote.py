"""Calls to the model services: one place that times them, counts bytes and maps failures.

Every call returns the response with a `Call` record (client-side RPC time,
the server's own reported time, the orchestrator's own protobuf encode/decode
time, serialized bytes each way), so the loop can split a round's time into
compute, serialization and network honestly. The messages are serialized
here, around a bytes-in/bytes-out channel call, so the encode and decode can
be timed per call without copying the payload again. A cache-miss status
becomes `CacheMiss` (recoverable: resend the committed tokens); an unreachable
service, one that cancelled the call, or a draining one (UNAVAILABLE
"draining: ...", specdec.runtime.drain) becomes `ServiceDown`.

Chunked prefill: a Score or Propose carrying more tokens than the replica's
per-request limit (GetInfo max_request_tokens, asked once per replica) is
sent as several calls: leading chunks of committed tokens with k = 0 (a
prefill: the service only extends its cache), then the last chunk with the
drafts (Score) or the drafting (Propose). The cache ends the same, so the
results are the same as one call's.

`SessionReplica` is one session's place on one role (the replica holding its
KV, and how many committed tokens that KV holds); its `call` is the one place
that recovers from a cache miss and moves to another replica, for both roles.

Gray failures: every attempt gets a deadline learned from that replica's
usual wall time for the same size of work (orchestrator.fleet.deadlines, through
the Router's ReplicaHealth). A draft attempt that misses it raises
`DeadlineMissed`: the round goes on without the draft. A target attempt that
misses it moves the session to another usable replica (resent from 0, the
same text); with none, it keeps waiting on the same call up to the call's
bound, then ServiceDown. Either way the replica is ejected from routing until
its probes answer (orchestrator.fleet.outliers), and a session on an ejected
replica moves before its next call (`ready`). A batch item's deadline is kept by
its batcher's one timer (CallBatcher.watch), not by a timer of its own.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import grpc

from orchestrator.common.calls import Call  # noqa: F401 - its home is the bottom room; imported from here too
from orchestrator.fleet.batching import CallBatcher, Late, Overlap, frame
from orchestrator.fleet.streams import BatchStream, NoStream, StreamFailed
from orchestrator.fleet.outliers import SESSION_MOVES, ReplicaHealth
from specdec.runtime import tracing
from specdec.core.fingerprint import EMPTY, extend
from specdec.runtime.errors import CACHE_MISS_PREFIX, CacheMiss, SpecdecError, Unavailable, status_code
from specdec.runtime.security import ServiceClientSecurity, aio_channel
from specdec.v1 import common_pb2, model_pb2


log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # Distributions for a long Check can exceed gRPC's 4 MB default.
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    # A restarted replica is back within seconds: retry the connection soon
    # (gRPC's default backoff grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# The replica is gone, going, or too slow; CANCELLED here is the server's (a
# replica stopped mid-call): the orchestrator's own cancellation never reaches _call.
_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# Draft statuses that are the request's own (the same on every replica): no move, fall back.
_REQUEST_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


class ServiceDown(Unavailable):
    """A model service did not answer (down, restarting, draining, or too slow)."""


class DeadlineMissed(ServiceDown):
    """A call did not answer within its learned deadline (a draft's round goes on without it)."""


class UpstreamError(SpecdecError):
    """Any other status from a model service, passed on with its code."""

    def __init__(self, code: grpc.StatusCode, message: str, *, detail: str = "") -> None:
        super().__init__(message, detail=detail)
        self.code = code


def _method_path(service: str, method: str) -> str:
    """"/specdec.v1.TargetService/Score" from the generated descriptors (no hand-typed names)."""
    full = model_pb2.DESCRIPTOR.services_by_name[service].methods_by_name[method].full_name
    return "/" + full.rsplit(".", 1)[0] + "/" + method


@dataclass(frozen=True)
class BatchCalls:
    """How a client gathers its sessions' Score/Propose calls into batch RPCs (orchestrator.fleet.batching)."""

    enabled: bool = True
    max_items: int = 64
    max_wait_s: float = 0.02
    wait_fraction: float = 0.5
    stream: bool = True  # batches as messages of one stream per replica (orchestrator.fleet.streams)
    overlap: bool = True  # two cohorts of sessions where they carry more (orchestrator.fleet.batching: Overlap)


_BATCH = {"Score": ("ScoreBatch", model_pb2.ScoreBatchResponse),
          "Propose": ("ProposeBatch", model_pb2.ProposeBatchResponse)}
_STREAM = {"Score": "ScoreStream", "Propose": "ProposeStream"}


class ModelClient:
    """A channel to one target or draft replica."""

    def __init__(self, address: str, role: str, *, timeout_s: float = 60.0,
                 security: ServiceClientSecurity | None = None, batch: BatchCalls | None = None) -> None:
        self.address = address
        self.role = role
        self.timeout_s = timeout_s
        self._request_limit: int | None = None  # GetInfo max_request_tokens (0: no limit known)
        self.max_batch = 0  # GetInfo max_batch, once asked (0: unknown)
        self.feature_dim = 0  # GetInfo feature_dim, once asked (0: unknown, or none)
        self.feature_kind = ""  # GetInfo feature_kind, once asked
        security = security or ServiceClientSecurity()
        self._metadata = security.metadata or None  # the service token, if any
        self.channel = aio_channel(address, security.credentials(), CHANNEL_OPTIONS)
        service = "TargetService" if role == "target" else "DraftService"
        # No serializer on either side: the call carries bytes, _call times the
        # protobuf work itself.
        verb = "Score" if role == "target" else "Propose"
        self._methods = {
            name: self.channel.unary_unary(_method_path(service, name))
            for name in ("GetInfo", "Release", "Fork", verb, _BATCH[verb][0])
        }
        batch = batch or BatchCalls()
        self._stream: BatchStream | None = None
        if batch.enabled and batch.stream:
            open_stream = self.channel.stream_stream(_method_path(service, _STREAM[verb]))
            self._stream = BatchStream(lambda: open_stream(metadata=self._metadata), _BATCH[verb][1].FromString,
                                       name=f"{role} {address} {_STREAM[verb]}", timeout_s=timeout_s)
        self._batcher: CallBatcher | None = None
        if batch.enabled:
            self._batcher = CallBatcher(partial(self._send_batch, verb), max_items=batch.max_items,
                                        max_wait_s=batch.max_wait_s, wait_fraction=batch.wait_fraction,
                                        overlap=Overlap(role, address, verb) if batch.overlap else None)

    @property
    def batcher(self) -> CallBatcher | None:
        return self._batcher

    def leave(self, session_id: str) -> None:
        """The session makes no more calls here (its turn ended, or it moved)."""
        if self._batcher is not None:
            self._batcher.leave(session_id)

    def _error(self, code: grpc.StatusCode, details: str) -> SpecdecError:
        """The exception a status from this replica becomes (the same for a call and a batch item)."""
        if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(CACHE_MISS_PREFIX):
            return CacheMiss(f"{self.role} {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._request_limit = None  # a restarted replica may have another limit: ask again
        if code in _DOWN:
            return ServiceDown(f"the {self.role} service is unavailable",
                               detail=f"{self.address}: {code.name}: {details}")
        return UpstreamError(code, f"the {self.role} service: {details}", detail=self.address)

    def _cost(self, request, response, start: float, end: float, sent: int, received: int,
              serialize_s: float) -> Call:
        timing = getattr(response, "timing", None)  # GetInfo/Release carry none
        return Call(
            rpc_ms=(end - start) * 1e3,
            server_ms=timing.total_ms if timing is not None else 0.0,
            bytes_sent=sent,
            bytes_received=received,
            serialize_ms=serialize_s * 1e3,
            forward_ms=timing.forward_ms if timing is not None else 0.0,
            batch_rows=int(getattr(timing, "batch_rows", 0)),
            batch_tokens=int(getattr(timing, "batch_tokens", 0)),
            tokens=len(getattr(request, "tokens", ())),
            forwards=int(getattr(timing, "forwards", 0)),
        )

    async def _send_batch(self, verb: str, items: list) -> list:
        """One batch RPC for the gathered items: per item (response, end time, decode seconds) or an error."""
        name, response_type = _BATCH[verb]
        payload = b"".join(frame(item.payload) for item in items)
        if self._stream is not None:
            try:
                batch, received = await self._stream.send(payload)
                end = time.perf_counter()
                return self._items(batch, len(items), received, end)
            except StreamFailed as exc:
                return [self._error(exc.code, exc.details)] * len(items)
            except NoStream:  # a replica without the stream: unary batch calls from now on
                log.info("%s %s has no %s: sending batch calls", self.role, self.address, _STREAM[verb])
                self._stream = None
        try:
            raw = await self._methods[name](payload, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a replica without batch calls
                log.info("%s %s has no %s: sending its calls one by one", self.role, self.address, name)
                self._batcher = None
                return await asyncio.gather(*(self._one(verb, item.payload) for item in items),
                                            return_exceptions=True)
            return [self._error(exc.code(), exc.details() or "")] * len(items)
        received = time.perf_counter()
        batch = response_type.FromString(raw)
        end = time.perf_counter()
        return self._items(batch, len(items), received, end)

    def _items(self, batch, n: int, received: float, end: float) -> list:
        """Per item of a batch response: (response, end time, its share of the decode) or its error."""
        share = (end - received) / max(1, n)
        out: list = []
        for i in range(n):
            status = batch.status[i] if i < len(batch.status) else None
            if status is None or i >= len(batch.items):
                out.append(UpstreamError(grpc.StatusCode.INTERNAL, f"the {self.role} service: a short batch reply"))
            elif status.code:
                out.append(self._error(status_code(status.code), status.message))
            else:
                out.append((batch.items[i], end, share))
        return out

    async def _one(self, verb: str, payload: bytes):
        raw = await self._methods[verb](payload, timeout=self.timeout_s, metadata=self._metadata)
        received = time.perf_counter()
        response_type = model_pb2.ScoreResponse if verb == "Score" else model_pb2.ProposeResponse
        response = response_type.FromString(raw)
        end = time.perf_counter()
        return response, end, end - received

    async def _call(self, name: str, request, response_type, timeout_s: float | None = None):
        # A traced call keeps its own trace context (tracing is configured once serving starts).
        if self._batcher is not None and name in _BATCH and not tracing.ENABLED:
            return await self._item(request)
        start = time.perf_counter()
        payload = request.SerializeToString()
        encoded = time.perf_counter()
        try:
            raw = await self._methods[name](payload, timeout=timeout_s or self.timeout_s,
                                            metadata=tracing.rpc_metadata(self._metadata))  # + the trace context
        except grpc.aio.AioRpcError as exc:
            tracing.rpc_span(self.role, name, self.address, start, encoded, None, time.perf_counter(), error=exc)
            raise self._error(exc.code(), exc.details() or "") from None
        received = time.perf_counter()
        response = response_type.FromString(raw)
        end = time.perf_counter()
        call = self._cost(request, response, start, end, len(payload), len(raw),
                          (encoded - start) + (end - received))
        tracing.rpc_span(self.role, name, self.address, start, encoded, received, end, call)
        return response, call

    async def get_info(self, timeout_s: float = 5.0) -> common_pb2.ModelInfo:
        response, _ = await self._call("GetInfo", common_pb2.GetInfoRequest(), common_pb2.ModelInfo, timeout_s)
        return response

    async def release(self, session_id: str, timeout_s: float = 5.0) -> bool:
        request = common_pb2.ReleaseRequest(session_id=session_id)
        response, _ = await self._call("Release", request, common_pb2.ReleaseResponse, timeout_s)
        return response.released

    async def fork(self, source: str, new: str, length: int, prefix_hash: int, timeout_s: float = 10.0,
                   tenant: str = "") -> int:
        """Fork (model.proto): `new` holds a copy of `source`'s first `length` tokens; its length."""
        request = model_pb2.ForkRequest(session_id=source, new_session_id=new, length=length,
                                        prefix_hash=prefix_hash, tenant=tenant)
        response, _ = await self._call("Fork", request, model_pb2.ForkResponse, timeout_s)
        return response.cache_length

    async def request_limit(self) -> int:
        """The replica's max_request_tokens (GetInfo, asked once); 0 when it reports none.
        Also keeps its max_batch (0: not reported), for admission (orchestrator.policy.capacity)."""
        if self._request_limit is None:
            info = await self.get_info()
            self._request_limit = int(info.max_request_tokens)
            self.max_batch = int(info.max_batch)
            self.feature_dim = int(info.feature_dim)
            self.feature_kind = info.feature_kind
        return self._request_limit

    def score(self, request: model_pb2.ScoreRequest) -> Pending:
        """The Score call, under way: await it for (response, Call)."""
        # The last chunk holds the k drafts and the committed token before them.
        return self._start("Score", request, model_pb2.ScoreResponse, tail=request.k + 1)

    def propose(self, request: model_pb2.ProposeRequest) -> Pending:
        """The Propose call, under way: await it for (response, Call)."""
        return self._start("Propose", request, model_pb2.ProposeResponse, tail=1)

    def _start(self, name: str, request, response_type, *, tail: int) -> Pending:
        """A round's call as an item of the next batch, its future waited on directly (no task, no
        coroutine: every session pays this per round); a call that is chunked, traced or not batched
        runs as a task of `_chunked`."""
        limit = self._request_limit
        if (self._batcher is None or tracing.ENABLED or limit is None
                or (limit and len(request.tokens) > limit and tail <= limit)):
            return Pending(asyncio.ensure_future(self._chunked(name, request, response_type, tail=tail)))
        return self._item(request)

    def _item(self, request) -> Pending:
        """`request` as an item of the next batch; its (response, Call) once answered (rpc_ms spans
        the wait for the batch to gather: it is part of the round's network time)."""
        start = time.perf_counter()
        payload = request.SerializeToString()
        encoded = time.perf_counter()

        def answered(out: tuple) -> tuple[Any, Call]:
            response, end, decode_s = out
            return response, self._cost(request, response, start, end, len(payload), response.ByteSize(),
                                        (encoded - start) + decode_s)

        item = self._batcher.submit_item(request.session_id, payload)
        return Pending(item.future, answered, item, self._batcher)

    async def _chunked(self, name: str, request, response_type, *, tail: int):
        """One call, or leading k = 0 chunks then the last one when `request` exceeds the limit."""
        limit = await self.request_limit()
        if not limit or len(request.tokens) <= limit or tail > limit:
            return await self._call(name, request, response_type)
        tokens = list(request.tokens)
        total: Call | None = None
        split = len(tokens) - limit  # the last call carries `limit` tokens
        position = int(request.cache_position)
        prefix = int(request.prefix_hash) if position else EMPTY
        rows = feature_rows(request)  # a Propose's features go with their tokens, chunk by chunk
        returned = []  # a Score's features of the leading chunks
        for start in range(0, split, limit):
            chunk = tokens[start : min(start + limit, split)]
            lead = type(request)()
            lead.CopyFrom(request)
            lead.cache_position, lead.prefix_hash, lead.k = position, prefix, 0
            lead.output_mode = common_pb2.OUTPUT_MODE_TOKENS  # a prefill's results are not used
            lead.ClearField("tokens")
            lead.tokens.extend(chunk)
            if rows is not None:
                slice_features(lead.features, rows, start, start + len(chunk))
            response, call = await self._call(name, lead, response_type)
            if getattr(request, "features", 0) and isinstance(request, model_pb2.ScoreRequest):
                returned.append(response.features)
            total = call if total is None else total + call
            position += len(chunk)
            for token in chunk:
                prefix = extend(prefix, token)
        last = type(request)()
        last.CopyFrom(request)
        last.cache_position, last.prefix_hash = position, prefix
        last.ClearField("tokens")
        last.tokens.extend(tokens[split:])
        if rows is not None:
            slice_features(last.features, rows, split, len(tokens))
        response, call = await self._call(name, last, response_type)
        if returned and response.HasField("features"):
            returned.append(response.features)
            merged = common_pb2.Features(first_position=int(request.cache_position), dim=returned[0].dim,
                                         encoding=returned[0].encoding, rows=sum(f.rows for f in returned),
                                         data=b"".join(f.data for f in returned))
            response.features.CopyFrom(merged)
        return response, total + call

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        await self.channel.close()


def feature_rows(request) -> common_pb2.Features | None:
    """A ProposeRequest's features (rows going with its tokens), or None."""
    if isinstance(request, model_pb2.ProposeRequest) and request.HasField("features") and request.features.rows:
        return request.features
    return None


def slice_features(out: common_pb2.Features, rows: common_pb2.Features, lo: int, hi: int) -> None:
    """`out` = rows lo..hi of `rows` (fewer where `rows` ends before hi)."""
    hi = min(hi, rows.rows)
    lo = min(lo, hi)
    width = len(rows.data) // rows.rows
    out.CopyFrom(common_pb2.Features(first_position=rows.first_position + lo, rows=hi - lo, dim=rows.dim,
                                     encoding=rows.encoding, data=rows.data[lo * width:hi * width]))


async def _within(task: asyncio.Future, timeout_s: float | None) -> bool:
    """Whether `task` is done within `timeout_s` (None: no limit); it is not cancelled either way.

    asyncio.wait({task}, timeout=...) with one waiter and one timer and no sets: every
    session's every call waits this way, so its cost is paid per round per session."""
    if task.done():
        return True
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout_s, wake) if timeout_s is not None else None
    task.add_done_callback(wake)
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()
        task.remove_done_callback(wake)
    return task.done()


class Pending:
    """A model call under way (ModelClient.score / propose): its future, and what its outcome
    becomes once done. Await it for (response, Call), or wait on `future` and read `result()`.
    A batch item's (`item`) is watched by its batcher for a deadline (`within`)."""

    __slots__ = ("future", "_finish", "item", "batcher")

    def __init__(self, future: asyncio.Future, finish: Callable[[Any], tuple[Any, Call]] | None = None,
                 item=None, batcher: CallBatcher | None = None) -> None:
        self.future, self._finish = future, finish
        self.item, self.batcher = item, batcher

    async def within(self, timeout_s: float | None) -> bool:
        """Whether the call is done within `timeout_s` (None: no limit); never cancelled here.
        A batch item is watched by its batcher's one timer (no timer per call): told Late, the
        call's `future` becomes the one its answer still comes to."""
        if self.item is None or timeout_s is None:
            return await _within(self.future, timeout_s)
        if not self.future.done():
            self.batcher.watch(self.item, time.monotonic() + timeout_s)
            try:
                await self.future
            except Exception:  # noqa: BLE001 - answered with an error: done (`result` raises it)
                return True
        elif self.future.cancelled() or self.future.exception() is not None:
            return True
        out = self.future.result()
        if isinstance(out, Late):
            self.future, self.item = out.answer, None  # its answer comes there; no longer watched
            return False
        return True

    def result(self) -> tuple[Any, Call]:
        """(response, Call) of the done call; raises its error."""
        out = self.future.result()
        return out if self._finish is None else self._finish(out)

    def __await__(self):
        yield from self.future.__await__()
        return self.result()


# Sends one request to `client` with the session's KV cropped to `cache_position`: the call under
# way (ModelClient.score / propose), or any awaitable of (response, Call).
Send = Callable[[ModelClient, int], Pending | Awaitable[tuple[Any, Call]]]


def _pending(call: Pending | Awaitable[tuple[Any, Call]]) -> Pending:
    return call if isinstance(call, Pending) else Pending(asyncio.ensure_future(call))


_BACKGROUND: set[asyncio.Task] = set()  # releases outliving the request that started them


@dataclass(frozen=True)
class Reply:
    """A model-service response, its cost, and the cache misses and missed deadlines on the way."""

    response: Any
    call: Call
    cache_misses: int = 0
    deadline_misses: int = 0


class ReplicaPicker(Protocol):
    """What a session's replica needs of the router (orchestrator.routing.Router implements it):
    its replicas' health and the pick of another replica."""

    health: ReplicaHealth

    async def pick(self, role: str, preferred: str = "", exclude: Collection[str] = (), *,
                   healthy: bool = False, room: Callable[[str], bool] | None = None) -> ModelClient | None: ...


class SessionReplica:
    """Where one session's KV lives on one role: the replica, and the committed tokens it holds.

    `held` is the caller's bookkeeping: set it to the crop length after each
    round (absolute, so a retried request is idempotent). One word for one
    length: the tokens a replica holds are `held` here, a request's
    cache_position and a reply's cache_length on the wire, and the session
    record's target_len / draft_len in Redis.
    """

    def __init__(self, router: ReplicaPicker, role: str, session_id: str, client: ModelClient, held: int = 0) -> None:
        self.router, self.role, self.session_id = router, role, session_id
        self.client = client
        self.held = held
        self.deadline_misses = 0  # this session's calls on this role that missed their deadline

    @property
    def address(self) -> str:
        return self.client.address

    async def ready(self) -> bool:
        """Before a call: off an ejected replica onto a usable one (resent from 0).

        False when this replica is ejected and no other is usable: a draft
        then sits out the round; a target is called anyway.
        """
        health = self.router.health
        if not health.ejected(self.role, self.address):
            return True
        other = await self.router.pick(self.role, exclude={self.address}, healthy=True)
        if other is None:
            return False
        log.info("session %s: %s replica %s is ejected (%s); moving to %s", self.session_id, self.role,
                 self.address, health.ejection_reason(self.role, self.address), other.address)
        self._move(other, "ejected")
        return True

    async def call(self, send: Send, committed: int, *, wait_s: float, extra: int = 0,
                   late_s: float = 0.0) -> Reply:
        """`send` from the held length on; resend from 0 on a cache miss; move when the replica is down.

        The service must receive at least one committed token, so the request
        starts at min(held, committed - 1); `extra` is the work beyond the
        committed tokens sent (a Score's drafted tokens, a Propose's k), for the
        deadline. A down replica is replaced by another live one (which
        holds nothing: resent from 0); with none left the call waits for one to
        come back, up to `wait_s`, then raises ServiceDown. A draining replica
        (specdec.runtime.drain) counts as down. On the draft, any other status
        that is not the request's own fault (RESOURCE_EXHAUSTED, INTERNAL,
        UNKNOWN, ...) moves the session too, and is raised (as UpstreamError)
        once no other replica is left; a missed deadline raises DeadlineMissed
        (a draft call given `late_s` is first waited on, up to that long: a
        strict request's, which must not go on without its draft).
        A target attempt that misses its deadline moves the session, or with no
        usable replica left waits on the same call, up to `wait_s`. The text
        cannot change: the tokens are the same.
        """
        bound = time.monotonic() + wait_s
        # How long a late answer is waited on: a target's up to the call's bound, a draft's late_s.
        late_bound = bound if self.role != "draft" else time.monotonic() + late_s
        await self.ready()
        position = min(self.held, committed - 1)
        tried = {self.address}
        misses = self.deadline_misses
        while True:
            try:
                response, call, cache_misses = await self._attempt(send, position, committed - position + extra,
                                                                   late_bound)
                return Reply(response, call, cache_misses, self.deadline_misses - misses)
            except DeadlineMissed as exc:
                other = await self.router.pick(self.role, exclude=tried, healthy=True)
                if self.role == "draft" or other is None:
                    raise
                log.warning("session %s: %s; moving to %s", self.session_id, exc, other.address)
                self._move(other, "deadline")
                position = 0
                tried.add(other.address)
            except (ServiceDown, UpstreamError) as exc:
                if isinstance(exc, UpstreamError) and not self._moves_on(exc.code):
                    raise
                other = await self.router.pick(self.role, exclude=tried)
                if other is None and time.monotonic() >= bound:
                    raise
                log.warning("session %s: %s; %s", self.session_id, exc,
                            f"moving to {other.address}" if other else "retrying")
                if other is None:
                    await asyncio.sleep(0.25)
                    tried = {self.address}  # a restarted replica may be back: any but this one next
                else:
                    self.client.leave(self.session_id)
                    self.client, self.held, position = other, 0, 0
                    tried.add(other.address)

    def _move(self, other: ModelClient, reason: str) -> None:
        """The session leaves this replica for `other` (which holds nothing of it)."""
        SESSION_MOVES.labels(self.role, reason).inc()
        self.client.leave(self.session_id)  # its batch calls stop counting on this session
        release_in_background(self.session_id, self.client)  # best effort: it may be hung
        self.client, self.held = other, 0

    async def _attempt(self, send: Send, position: int, size: int, bound: float) -> tuple[Any, Call, int]:
        """One send (and its cache-miss resend from 0) under the replica's learned deadline.

        The call's own future is waited on (no task per call: every session pays this per round)."""
        health = self.router.health
        role, address = self.role, self.address
        own, size = size, health.latency.begin(role, address, size)  # the replica's load counts
        limit = health.deadline_s(role, address, size)
        started = time.monotonic()
        pending, misses, late = _pending(send(self.client, position)), 0, False
        try:
            while True:
                left = None if limit is None else limit - (time.monotonic() - started)
                if not late and not await pending.within(left):
                    self.deadline_misses += 1
                    health.missed(role, address, size, limit)
                    missed = DeadlineMissed(f"the {role} service missed its deadline",
                                            detail=f"{address}: {own} tokens ({size} with the calls in flight "
                                                   f"there), no answer within {limit * 1e3:.0f} ms")
                    if ((role == "draft" and time.monotonic() >= bound)
                            or await self.router.pick(role, exclude={address}, healthy=True)):
                        raise missed
                    late = True  # waited on longer; its answer is not learned (a hang must not raise the deadline)
                if late:
                    await self._wait_longer(pending.future, bound, missed)
                try:
                    response, call = pending.result()
                except CacheMiss:
                    if position == 0:
                        raise
                    log.info("session %s: %s cache miss at %d; resending from 0", self.session_id, role, position)
                    position, misses = 0, 1
                    pending = _pending(send(self.client, 0))
                    continue
                break
        finally:
            health.latency.end(role, address, own)
            if not pending.future.done():
                pending.future.cancel()  # the RPC is cancelled; the replica drops it at its next step
        if not misses and not late:  # a clean answer, in time: what this size costs here
            health.answered(role, address, size, (time.monotonic() - started) * 1e3)
        return response, call, misses

    async def _wait_longer(self, task: asyncio.Task, bound: float, missed: DeadlineMissed) -> None:
        """A late target call with no other replica usable: wait up to `bound`, moving if one appears."""
        while not task.done():
            left = bound - time.monotonic()
            if left <= 0:
                raise ServiceDown(f"the {self.role} service did not answer in time",
                                  detail=f"{self.address}: still no answer at the bound ({missed.detail})")
            await asyncio.wait({task}, timeout=min(0.25, left))
            if not task.done() and await self.router.pick(self.role, exclude={self.address}, healthy=True):
                raise missed

    def _moves_on(self, code: grpc.StatusCode) -> bool:
        """Whether an UpstreamError with `code` is a reason to try another replica of this role."""
        return self.role == "draft" and code not in _REQUEST_FAULTS


async def place(
    router: ReplicaPicker, role: str, session_id: str, preferred: str, held: int, *, wait_s: float = 0.0,
    room: Callable[[str], bool] | None = None,
) -> SessionReplica | None:
    """Route a session on `role`: to `preferred` (holding `held` of its tokens) while usable, else elsewhere from 0.

    With no replica of `role` to be found, waits up to `wait_s` for one to
    appear (a replica restarting, or Redis back empty before the replicas'
    next heartbeat), then answers None. `room` limits the choice (admission).
    """
    deadline = time.monotonic() + wait_s
    while (client := await router.pick(role, preferred, room=room)) is None:
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.25)
    return SessionReplica(router, role, session_id, client, held if client.address == preferred else 0)


async def release_kv(session_id: str, clients: Sequence[ModelClient | None]) -> None:
    """Free a session's KV on the services (best effort: a service's own LRU/TTL is the backstop)."""
    for client in clients:
        if client is not None:
            try:
                await client.release(session_id)
            except Exception as exc:  # noqa: BLE001 - cleanup must not mask the cause
                log.warning("release of %s on %s failed: %s", session_id, client.address, exc)


def in_background(coro: Awaitable[None]) -> None:
    """Run `coro` without waiting for it (kept referenced until it ends)."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def release_in_background(session_id: str, *clients: ModelClient | None) -> None:
    in_background(release_kv(session_id, clients))

"""What both model servicers share: Release, GetInfo, batch calls and the common response parts.

A role's servicer adds its one verb (target_service: Score, draft_service:
Propose) as two small functions, `prepare` (decode and check a request into
the role's Work) and `respond` (a finished Work into the response); the base
runs them for the single call and for the batch call (ScoreBatch,
ProposeBatch), whose items are queued together so they can share a forward and
get one status each, and for the batch stream (ScoreStream, ProposeStream): batch
calls as messages of one long-lived stream, each run as it arrives and answered
as it finishes, with no call set-up per batch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from engine.host import ModelHost, SessionWork
from engine.scheduler import Work
from specdec.runtime.drain import Drain, Draining
from specdec.runtime.errors import InvalidArgument, new_request_id, status_for
from model_service.requests import ModelRequest, decode_request, require_session_id
from specdec.runtime.limits import MAX_SESSION_ID
from specdec.v1 import common_pb2, model_pb2

log = logging.getLogger(__name__)

# The one kind of feature served (ModelInfo.feature_kind): the target's final
# hidden state after its final norm (engine.model.drafts).
FEATURE_KIND = "last-normed"
from specdec.runtime.wire import encode_probs


class ModelServicerBase:
    """Release and GetInfo, identical for both roles; `role` names the subclass's role."""

    role = ""
    response_type: Any = None  # the verb's response message (ScoreResponse, ProposeResponse)

    def __init__(self, host: ModelHost):
        self.host = host
        self.drain: Drain | None = None  # the server's (model_service.serve): a stream's batches are gated

    def decode(self, request: Any) -> ModelRequest:
        return decode_request(request, self.host.loaded, self.host.limits)

    def prepare(self, request: Any) -> Work:
        """The role's Work for one request (raises on bad input)."""
        raise NotImplementedError

    def _work(self, request: Any) -> Work:
        """`prepare`, with the request's tenant on the Work (the KV cache's fair eviction)."""
        work = self.prepare(request)
        work.tenant = request.tenant
        return work

    def respond(self, request: Any, done: SessionWork, started: float, response: Any) -> Any:
        """The role's response to one finished request, filled into `response` (an empty message
        of response_type: a batch's item is filled in place, not built apart and copied in)."""
        raise NotImplementedError

    def features(self) -> tuple[int, str]:
        """ModelInfo.feature_dim and .feature_kind for this role (none by default)."""
        return 0, ""

    async def _single(self, request: Any) -> Any:
        started = time.perf_counter()
        work = self._work(request)
        return self.respond(request, await self.host.serve(work), started, self.response_type())

    async def _batch(self, batch: Any, response: Any, method: str) -> Any:
        """Each item prepared alone (bad input fails it alone), all queued at once."""
        started = time.perf_counter()
        request_id = new_request_id()
        works: list[Work] = []
        index: list[int] = []
        outcomes: list[Any] = [None] * len(batch.items)
        for i, item in enumerate(batch.items):
            try:
                works.append(self._work(item))
                index.append(i)
            except Exception as exc:  # this item's own status
                outcomes[i] = exc
        if works:
            for i, done in zip(index, await self.host.serve_many(works)):
                outcomes[i] = done
        for item, outcome in zip(batch.items, outcomes):
            if isinstance(outcome, BaseException):
                code, message = status_for(outcome, method, request_id)
                response.items.add()
                response.status.add(code=code.value[0], message=message)
            else:
                self.respond(item, outcome, started, response.items.add())
                response.status.add(code=0)
        return response

    async def _stream(self, batches: AsyncIterator[Any], response_type: type, method: str,
                      path: str) -> AsyncIterator[Any]:
        """A batch stream: every batch message runs as `_batch` as soon as it arrives (several at
        once, as separate batch calls would), and its response goes out as soon as it is done,
        with the request's batch_id. When the server begins to drain, the stream reads no more
        batches, answers those it has and ends (a stream would otherwise hold the server's stop
        for its whole grace period); a batch the caller sent after that fails on its side with
        the stream's end, as a call to a stopping replica does, and its sessions move. A batch
        read just as the drain begins is refused item by item (UNAVAILABLE "draining:")."""
        loop = asyncio.get_running_loop()
        done: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        def refused(batch: Any, exc: BaseException) -> Any:
            """Every item of the batch failed with `exc`'s status."""
            response, request_id = response_type(), new_request_id()
            code, message = status_for(exc, method, request_id)
            for _ in batch.items:
                response.items.add()
                response.status.add(code=code.value[0], message=message)
            return response

        async def run(batch: Any) -> None:
            try:
                if self.drain is not None:
                    self.drain._enter(path)
            except Draining as exc:
                response = refused(batch, exc)
            else:
                try:
                    response = await self._batch(batch, response_type(), method)
                except Exception as exc:  # noqa: BLE001 - answered, never left waiting
                    response = refused(batch, exc)
                finally:
                    if self.drain is not None:
                        self.drain._exit()
            response.batch_id = batch.batch_id
            done.put_nowait(response)

        async def read() -> None:
            async for batch in batches:
                task = loop.create_task(run(batch))
                running.add(task)
                task.add_done_callback(running.discard)

        async def finish(reader: asyncio.Task) -> None:
            """The caller closed its side, the stream broke, or the drain began: no more batches;
            those running are answered, then the stream ends."""
            ends = [reader] if self.drain is None else [reader, loop.create_task(self.drain.began.wait())]
            try:
                await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in ends:
                    task.cancel()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                log.debug("%s: the stream broke: %s", path, reader.exception())
            if running:
                await asyncio.wait(set(running))
            done.put_nowait(None)

        reader = loop.create_task(read())
        closer = loop.create_task(finish(reader))
        try:
            while (response := await done.get()) is not None:
                yield response
        finally:
            closer.cancel()
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def Release(self, request: common_pb2.ReleaseRequest, context: Any) -> common_pb2.ReleaseResponse:
        timed = await self.host.run(self.host.release, require_session_id(request.session_id))
        return common_pb2.ReleaseResponse(released=timed.value)

    async def Fork(self, request: Any, context: Any) -> Any:
        """A new session holding a copy of another's first `length` tokens (on the worker)."""
        source = require_session_id(request.session_id)
        if not request.new_session_id:
            raise InvalidArgument("new_session_id must not be empty")
        for name in ("session_id", "new_session_id"):
            if len(getattr(request, name)) > MAX_SESSION_ID:
                raise InvalidArgument(f"{name} must be at most {MAX_SESSION_ID} characters")
        if request.new_session_id == source:
            raise InvalidArgument("new_session_id must differ from session_id")
        timed = await self.host.run(self.host.fork, source, request.new_session_id, int(request.length),
                                    int(request.prefix_hash), request.tenant)
        return model_pb2.ForkResponse(cache_length=timed.value)

    async def GetInfo(self, request: common_pb2.GetInfoRequest, context: Any) -> common_pb2.ModelInfo:
        m = self.host.loaded
        feature_dim, feature_kind = self.features()
        return common_pb2.ModelInfo(
            model_name=m.name,
            role=self.role,
            vocab_size=m.vocab_size,
            tokenizer_fingerprint=m.tokenizer_fingerprint,
            eos_token_ids=list(m.eos_token_ids),
            context_length=m.context_length,
            device=str(m.device),
            dtype=str(m.dtype).removeprefix("torch."),
            parameter_count=m.parameter_count,
            max_k=self.host.limits.max_k,
            replica_id=self.host.replica_id,
            max_request_tokens=self.host.limits.max_request_tokens,
            max_batch=self.host.max_batch,
            feature_dim=feature_dim,
            feature_kind=feature_kind,
            num_layers=m.num_layers,
        )


def fill_response(response: Any, work: SessionWork, started: float, probs: torch.Tensor | None) -> Any:
    """Set a Score/Propose response's cache_length, timing and (PROBS mode) probs; return it."""
    response.cache_length = work.cache_length
    timing = response.timing  # filled in place
    timing.queue_ms, timing.forward_ms = work.queue_ms, work.forward_ms
    timing.total_ms = (time.perf_counter() - started) * 1e3
    timing.batch_rows, timing.batch_tokens, timing.forwards = work.batch_rows, work.batch_tokens, work.forwards
    if probs is not None:
        response.probs.CopyFrom(encode_probs(probs))
    return response

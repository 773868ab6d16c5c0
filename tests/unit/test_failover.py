"""Failover by status: which model-service errors move a session, fall back, or fail the request.

Driven through the real loop with test_loop's in-process fakes. A draft error
that is not the request's own fault moves the session to another draft replica,
else falls back to target-only; INVALID_ARGUMENT from the draft falls back too
(logged as our bug). A target call cut by its server (CANCELLED, e.g. a drain
deadline) moves the session like UNAVAILABLE does. The text never changes.
"""
from __future__ import annotations

import logging

import grpc
import pytest

from orchestrator.fleet.remote import UpstreamError
from orchestrator.common.kinds import DRAFT, NONE
from tests.unit.test_loop import PROMPTS, Stack, make_models, plain_greedy


def _fail_with(service, code: grpc.StatusCode, after: int) -> None:
    """Make `service` answer `code` from its (after + 1)-th call of its verb on."""
    for verb in ("score", "propose"):
        inner = getattr(service, verb)
        calls = [0]

        async def failing(request, inner=inner, calls=calls):
            calls[0] += 1
            if calls[0] > after:
                raise UpstreamError(code, f"{service.role} service at {service.address}: {code.name}")
            return await inner(request)

        setattr(service, verb, failing)


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                  grpc.StatusCode.INVALID_ARGUMENT])
def test_any_draft_error_falls_back_to_target_only(code, caplog) -> None:
    target, draft = make_models(1)
    stack = Stack(target, draft)
    _fail_with(stack.services["d0"], code, after=2)
    with caplog.at_level(logging.WARNING):
        out, _, tally = stack.run(PROMPTS[1], k=3)
    assert out == plain_greedy(target, PROMPTS[1])
    assert tally.proposer == NONE and code.name in tally.fallback_reason
    assert tally.draft_calls == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "draft" in r.getMessage()]
    assert bool(errors) == (code == grpc.StatusCode.INVALID_ARGUMENT)  # our bug: logged as an error


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INTERNAL])
def test_a_failing_draft_replica_moves_the_session_to_another(code) -> None:
    target, draft = make_models(1)
    stack = Stack(target, draft, drafts=2)
    for name in ("d0", "d1"):
        _fail_with(stack.services[name], code, after=2)  # whichever the session starts on
    out, _, tally = stack.run(PROMPTS[1], k=3)
    assert out == plain_greedy(target, PROMPTS[1])
    # Two calls on the first replica, two on the second (resent from 0), then target-only.
    assert tally.draft_calls == 4 and tally.proposer == NONE


def test_a_strict_request_fails_on_any_draft_error() -> None:
    from specdec.runtime.errors import Unavailable

    target, draft = make_models(1)
    stack = Stack(target, draft)
    _fail_with(stack.services["d0"], grpc.StatusCode.RESOURCE_EXHAUSTED, after=1)
    with pytest.raises(Unavailable, match="strict"):
        stack.run(PROMPTS[1], k=3, strict=True)


@pytest.mark.parametrize("path", ["alone", "batch call", "batch stream"])
@pytest.mark.parametrize("code, details, down", [
    (grpc.StatusCode.CANCELLED, "stopped", True),  # the server stopped mid-call
    (grpc.StatusCode.UNAVAILABLE, "draining: this replica is shutting down", True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens: too many", False),
])
def test_statuses_that_mean_the_replica_is_gone(code, details, down, path) -> None:
    """What ModelClient raises for a status: ServiceDown moves the session on either role,
    whether the call went alone, in a batch call or on the batch stream."""
    import asyncio

    from grpc.aio import AioRpcError, Metadata

    from orchestrator.fleet.remote import BatchCalls, ModelClient, ServiceDown
    from orchestrator.fleet.streams import StreamFailed
    from specdec.v1 import model_pb2

    async def run():
        client = ModelClient("127.0.0.1:1", "target", batch=BatchCalls(enabled=path != "alone",
                                                                        stream=path == "batch stream"))

        async def method(payload, **kwargs):
            raise AioRpcError(code, Metadata(), Metadata(), details=details)

        async def broken(payload):  # the stream ended with this status under the batch
            raise StreamFailed(code, details)

        client._methods["Score"] = client._methods["ScoreBatch"] = method
        if client._stream is not None:
            client._stream.send = broken
        client._request_limit = 0
        try:
            await client.score(model_pb2.ScoreRequest(session_id="s", tokens=[1]))
        finally:
            await client.close()

    with pytest.raises(ServiceDown if down else UpstreamError) as info:
        asyncio.run(run())
    assert details in info.value.detail + str(info.value)

"""Sessions belong to their tenant; admission limits answer RESOURCE_EXHAUSTED naming the limit."""
from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from client import AsyncClient, build_request
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

PROMPT = "one two three four five six seven eight nine ten"


def _stub(secured):
    creds = grpc.ssl_channel_credentials(secured.pki.ca.read_bytes())
    channel = grpc.secure_channel(secured.address("orch"), creds)
    return channel, orchestrator_pb2_grpc.OrchestratorStub(channel)


def _as(secured, tenant: str):
    return (("authorization", f"Bearer {secured.tokens[tenant]}"),)


def _kept(prompt: str, session_id: str = "", max_new_tokens: int = 6) -> pb.GenerateRequest:
    request = build_request(prompt, max_new_tokens=max_new_tokens, session_id=session_id)
    if "keep_session" in pb.GenerateRequest.DESCRIPTOR.fields_by_name:
        request.keep_session = True  # multi-turn (single-turn records are dropped at the end)
    return request


def _run(stub, request, metadata) -> pb.Stats:
    stats = None
    for response in stub.Generate(request, timeout=60, metadata=metadata):
        if response.HasField("stats"):
            stats = response.stats
    return stats


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_another_tenant_learns_nothing_about_a_session(secured) -> None:
    channel, stub = _stub(secured)
    bob, carol = _as(secured, "bob"), _as(secured, "carol")
    with channel:
        first = _run(stub, _kept(PROMPT), bob)
        session = first.session_id
        unknown = "f" * len(session)
        again = _run(stub, _kept(PROMPT + " eleven", session), bob)
        assert again.reused_prompt_tokens > 0  # the owner reuses its prefix

        # Carol: the real id and a made-up one answer the same, apart from the id itself.
        answers = []
        for sid in (session, unknown):
            err = _error(lambda: _run(stub, _kept(PROMPT + " eleven", sid), carol))
            answers.append((err.code(), err.details().replace(sid, "<id>")))
        assert answers[0] == answers[1]
        assert answers[0][0] == grpc.StatusCode.NOT_FOUND
        # Nor can she end it, and ending it tells nothing either.
        for sid in (session, unknown):
            assert stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30,
                                   metadata=carol).existed is False

        # Bob's session is untouched.
        third = _run(stub, _kept(PROMPT + " eleven twelve", session), bob)
        assert third.session_id == session and third.reused_prompt_tokens > 0
        assert stub.EndSession(pb.EndSessionRequest(session_id=session), timeout=30,
                               metadata=bob).existed is True


def _rejections(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("specdec_limit_rejections_total{"):
            key, value = line.rsplit(" ", 1)
            out[key.split('limit="')[1].split('"')[0]] = float(value)
    return out


def test_request_bytes_are_capped_before_tokenising(secured) -> None:
    channel, stub = _stub(secured)
    before = _rejections(secured.metrics_port).get("max_request_bytes", 0.0)
    with channel:
        err = _error(lambda: _run(stub, build_request("x" * 70_000, max_new_tokens=2),
                                  _as(secured, "dave")))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("max_request_bytes:")
    assert _rejections(secured.metrics_port)["max_request_bytes"] == before + 1


def test_concurrent_streams_per_tenant(secured) -> None:
    async def one(client: AsyncClient):
        try:
            await client.complete(PROMPT, max_new_tokens=120, proposer="none")
            return "ok"
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()

    async def main():
        async with AsyncClient(secured.address("orch"), token=secured.tokens["dave"],
                               ca=str(secured.pki.ca), timeout=120) as c:
            return await asyncio.gather(*(one(c) for _ in range(4)))

    results = asyncio.run(main())
    refused = [r for r in results if r != "ok"]
    assert results.count("ok") >= 1 and refused, results
    assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED
               and details.startswith("max_streams_per_tenant:") for code, details in refused)
    assert _rejections(secured.metrics_port)["max_streams_per_tenant"] >= len(refused)


def test_requests_per_second_per_tenant(secured) -> None:
    channel, stub = _stub(secured)
    codes = []
    with channel:
        # Burst 8, 4 a second: until refused, up to 40 calls (they would have to average 200 ms
        # each, EndSession of a missing session, for the bucket to keep up).
        while grpc.StatusCode.RESOURCE_EXHAUSTED not in codes and len(codes) < 40:
            try:
                stub.EndSession(pb.EndSessionRequest(session_id="nope"), timeout=30,
                                metadata=_as(secured, "erin"))
                codes.append("ok")
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert exc.details().startswith("rate_per_tenant:")
        # Another tenant is not affected.
        stub.EndSession(pb.EndSessionRequest(session_id="nope"), timeout=30,
                        metadata=_as(secured, "carol"))
    assert codes[:8] == ["ok"] * 8
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes

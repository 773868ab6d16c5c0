"""Bad input gets a clear status naming the field; sessions: multi-turn reuse, disconnects."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specdec.v1 import common_pb2, model_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.addresses["orch"]) as channel:
        yield orchestrator_pb2_grpc.OrchestratorStub(channel)


def _generate(stub, **fields) -> list[pb.GenerateResponse]:
    fields.setdefault("max_new_tokens", 4)
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))


BAD = [
    ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ({"prompt": "hi", "messages": [pb.ChatMessage(role="user", content="hi")]},
     grpc.StatusCode.INVALID_ARGUMENT, "prompt and messages"),
    ({"messages": [pb.ChatMessage(role="", content="hi")]}, grpc.StatusCode.INVALID_ARGUMENT,
     "messages[0].role"),
    ({"prompt": "the cat " * 400}, grpc.StatusCode.OUT_OF_RANGE, "prompt"),
    ({"prompt": "hi", "max_new_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 100000}, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 512}, grpc.StatusCode.OUT_OF_RANGE, "max_new_tokens"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=-1)},
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=1, top_k=-3)},
     grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=1, top_p=1.5)},
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=1, top_p=0.0)},
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=1, min_p=1.0)},
     grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    ({"prompt": "hi", "proposer": 99}, grpc.StatusCode.INVALID_ARGUMENT, "proposer"),
    ({"prompt": "hi", "proposer": pb.PROPOSER_GUESS}, grpc.StatusCode.INVALID_ARGUMENT, "guess"),
    ({"prompt": "hi", "k": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "k"),
    ({"prompt": "hi", "stop": [""]}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ({"prompt": "hi", "session_id": "no-such-session"}, grpc.StatusCode.NOT_FOUND, "session_id"),
]


@pytest.mark.parametrize("fields,code,field_name", BAD, ids=[b[2] + "-" + b[1].name for b in BAD])
def test_bad_generate_request_gets_a_clear_status(stub, fields, code, field_name):
    with pytest.raises(grpc.RpcError) as info:
        _generate(stub, **fields)
    assert info.value.code() == code, info.value.details()
    assert field_name in info.value.details()


def test_bad_check_and_end_session_requests(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(pb.CheckRequest(prompt="hi", guess=""), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guess" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(pb.CheckRequest(prompt="hi", guess="the cat " * 40), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guess" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(pb.CheckRequest(prompt="", guess="x"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.EndSession(pb.EndSessionRequest(session_id=""), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_server_still_serves_after_bad_input(client):
    assert client.complete("The cat", max_new_tokens=3).stats.new_tokens == 3


def test_multi_turn_reuses_the_cached_prefix(client):
    turn1 = [{"role": "user", "content": "Tell me about the cat."}]
    first = client.complete(messages=turn1, max_new_tokens=12, proposer="draft", k=3,
                            keep_session=True)
    sid = first.stats.session_id
    assert first.stats.reused_prompt_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "And the dog?"}]
    second = client.complete(messages=turn2, max_new_tokens=12, proposer="draft", k=3, session_id=sid)
    assert second.stats.session_id == sid
    # The whole first prompt (at least) is served from the services' caches.
    assert second.stats.reused_prompt_tokens >= first.stats.prompt_tokens
    assert second.stats.reused_prompt_tokens < second.stats.prompt_tokens
    # ...and the answer is the one a fresh session gives.
    fresh = client.complete(messages=turn2, max_new_tokens=12, proposer="draft", k=3)
    assert fresh.stats.reused_prompt_tokens == 0
    assert second.token_ids == fresh.token_ids
    # A third turn on the same session keeps going.
    turn3 = turn2 + [{"role": "assistant", "content": second.text}, {"role": "user", "content": "Ok."}]
    third = client.complete(messages=turn3, max_new_tokens=5, proposer="none", session_id=sid)
    assert third.stats.reused_prompt_tokens >= second.stats.prompt_tokens
    assert client.end_session(sid)


def test_disconnect_mid_stream_keeps_a_kept_session_and_frees_a_single_turn_one(client, stack):
    first = client.complete("The cat sat", max_new_tokens=4, proposer="draft", k=2, keep_session=True)
    sid = first.stats.session_id
    stream = client.generate("The cat sat", max_new_tokens=400, proposer="draft", k=2, session_id=sid)
    for i, _ in enumerate(stream):
        if i == 2:
            stream.cancel()
            break
    time.sleep(0.5)
    assert asyncio.run(_record_exists(stack, sid))  # a cancelled turn never deletes the session
    assert client.end_session(sid) is True

    # A single-turn stream: its KV goes at once on both services (only a resume would come back).
    before = _active(stack)
    stream = client.generate("The cat sat", max_new_tokens=400, proposer="draft", k=2)
    for i, _ in enumerate(stream):
        if i == 2:
            sid = stream.session_id
            stream.cancel()
            break
    # The orchestrator sees the cancellation and releases in the background: wait for the services'
    # session counts to come back (a bounded wait, not a fixed sleep), then probe.
    deadline = time.monotonic() + 20
    while _active(stack) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    # One probe each: Release answers whether the service still held the session.
    held = {role: _release(stack.addresses[role], role, sid) for role in ("target", "draft")}
    assert held == {"target": False, "draft": False}, "KV still held after the client left"


def _active(stack) -> tuple[float, float]:
    """Sessions holding KV on the target and on the draft (their specdec_active_sessions)."""
    import urllib.request

    def active(port: int) -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith("specdec_active_sessions"))

    return active(stack.target_metrics_port), active(stack.draft_metrics_port)


async def _record_exists(stack, session_id: str) -> bool:
    from specdec.runtime.store import SessionStore, connect

    redis = connect(stack.redis_url)
    try:
        return await SessionStore(redis, prefix=stack.prefix).load(session_id) is not None
    finally:
        await redis.aclose()


def _release(address: str, role: str, session_id: str) -> bool:
    """Release directly on a service: True if it still held the session."""
    with grpc.insecure_channel(address) as channel:
        stub_type = model_pb2_grpc.TargetServiceStub if role == "target" else model_pb2_grpc.DraftServiceStub
        return stub_type(channel).Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=5).released

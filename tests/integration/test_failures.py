"""Failures: a draft that dies, services restarted mid-session, Redis down, a mismatched pair."""
from __future__ import annotations

import time

import grpc
import pytest

from client import Client
from specdec.runtime import procs
from tests.integration.stack import Stack

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def private(tiny_pair, tmp_path_factory):
    """Static addresses (no registry), so services can be stopped and restarted on their ports."""
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("failures"))
    try:
        t = s.start_service("target", "target", target_dir, register=False)
        d = s.start_service("draft", "draft", draft_dir, register=False)
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d])
        with Client(s.addresses["orch"], timeout=60) as c:
            yield s, c, tiny_pair
    finally:
        s.stop()


def _restart(stack: Stack, name: str, role: str, model) -> None:
    port = int(stack.addresses[name].rsplit(":", 1)[1])
    stack.stop_one(name)
    stack.start_service(name, role, model, register=False, port=port)


def test_restarted_services_mid_session_give_identical_text(private):
    stack, c, (target_dir, draft_dir) = private
    turn1 = [{"role": "user", "content": "Tell me about the cat."}]
    first = c.complete(messages=turn1, max_new_tokens=10, proposer="draft", k=3, keep_session=True)
    sid = first.stats.session_id
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
    expected = c.complete(messages=turn2, max_new_tokens=20, proposer="none")

    _restart(stack, "target", "target", target_dir)
    second = c.complete(messages=turn2, max_new_tokens=20, proposer="draft", k=3, session_id=sid)
    assert second.token_ids == expected.token_ids
    assert second.stats.cache_misses >= 1  # the target lost the session: resent from 0

    _restart(stack, "draft", "draft", draft_dir)
    turn3 = turn2 + [{"role": "assistant", "content": second.text}, {"role": "user", "content": "Ok."}]
    expected3 = c.complete(messages=turn3, max_new_tokens=20, proposer="none")
    third = c.complete(messages=turn3, max_new_tokens=20, proposer="draft", k=3, session_id=sid)
    assert third.token_ids == expected3.token_ids
    assert third.stats.cache_misses >= 1  # now the draft lost it
    assert third.stats.reused_prompt_tokens > 0  # the target still had it


def test_draft_down_falls_back_to_target_only_or_fails_when_strict(private):
    stack, c, (target_dir, draft_dir) = private
    expected = c.complete(PROMPT, max_new_tokens=16, proposer="none")
    stack.stop_one("draft")
    try:
        out = c.complete(PROMPT, max_new_tokens=16, proposer="draft", k=4)
        assert out.token_ids == expected.token_ids
        assert out.stats.proposer == "none" and "draft" in out.stats.fallback_reason
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            c.complete(PROMPT, max_new_tokens=16, proposer="draft", k=4, strict=True)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draft" in info.value.details()
        assert time.monotonic() - started < 10
    finally:
        stack.start_service("draft", "draft", draft_dir, register=False,
                            port=int(stack.addresses["draft"].rsplit(":", 1)[1]))
    # Back within a reconnect backoff (at most 1 s): the draft is used again.
    deadline = time.monotonic() + 10
    while True:
        again = c.complete(PROMPT, max_new_tokens=16, proposer="draft", k=4)
        assert again.token_ids == expected.token_ids
        if not again.stats.fallback_reason or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not again.stats.fallback_reason and again.stats.draft_calls > 0


def test_redis_unreachable_is_unavailable_not_a_hang(private):
    stack, _, (target_dir, _) = private
    dead = f"redis://127.0.0.1:{procs.free_port()}/0"
    address = stack.start_orchestrator("orch-noredis", target_dir, redis_url=dead,
                                       targets=[stack.addresses["target"]],
                                       extra=("--redis-outage-s", "1"))
    try:
        with Client(address, timeout=30, retries=0) as c:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:  # a kept session's state must land
                c.complete(PROMPT, max_new_tokens=4, keep_session=True)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "redis" in info.value.details()
            assert time.monotonic() - started < 5
    finally:
        stack.stop_one("orch-noredis")


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(private, tmp_path):
    from tests.tiny import build_model

    stack, _, (target_dir, _) = private
    other = build_model(tmp_path / "other", seed=3, vocab_size=320)
    foreign = stack.start_service("foreign", "draft", other, register=False)
    try:
        stack.start_orchestrator("orch-mismatch", target_dir, targets=[stack.addresses["target"]],
                                 drafts=[foreign], wait=False)
        proc = stack.procs["orch-mismatch"]
        assert proc.wait(timeout=60) == 2
        log = (stack.logs / "orch-mismatch.log").read_text()
        assert "do not share a vocabulary" in log and "refusing" in log
    finally:
        stack.stop_one("orch-mismatch")
        stack.stop_one("foreign")

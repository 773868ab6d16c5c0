"""A real target process's KV cache is fair between tenants (ScoreRequest.tenant): a flood of one
tenant's sessions evicts its own, and never another tenant's session between its rounds."""
from __future__ import annotations

import grpc

from specdec.core.fingerprint import fingerprint
from specdec.v1 import model_pb2
from tests.service.conftest import score

PROMPT = [5, 6, 7, 8, 9, 10]


def _hit(stub, session: str, tenant: str) -> bool:
    """Whether `session` still holds PROMPT: a continuation at its end, or a cache miss."""
    try:
        score(stub, session, PROMPT + [11], len(PROMPT), [11], tenant=tenant)
        return True
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
        return False


def _flood(stub, tenant: str, count: int) -> None:
    for i in range(count):
        score(stub, f"{tenant or 'anon'}-flood-{i}", PROMPT, 0, PROMPT, tenant=tenant)


def test_a_flood_of_one_tenant_never_evicts_another_tenants_session(services, tiny_pair):
    target = services("target", tiny_pair[0], "--max-sessions", "6")
    stub = target.stub
    score(stub, "bob-active", PROMPT, 0, PROMPT, tenant="bob")  # between its rounds: idle, oldest
    _flood(stub, "mallory", 30)
    assert _hit(stub, "bob-active", "bob")
    stub.Fork(model_pb2.ForkRequest(session_id="bob-active", new_session_id="bob-fork", length=len(PROMPT),
                                    prefix_hash=fingerprint(PROMPT), tenant="bob"), timeout=30)
    _flood(stub, "mallory", 30)
    assert _hit(stub, "bob-active", "bob") and _hit(stub, "bob-fork", "bob")
    # Requests without a tenant (an older orchestrator's) are one tenant: its flood evicts its own.
    score(stub, "anon-oldest", PROMPT, 0, PROMPT)
    _flood(stub, "", 30)
    assert not _hit(stub, "anon-oldest", "")

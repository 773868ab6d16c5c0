"""TLS on every hop, tokens, open health, request ids, the loopback-only default."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client
from specdec.runtime import procs
from specdec.runtime.launch import service_argv
from specdec.v1 import common_pb2, model_pb2, model_pb2_grpc
from specdec.v1 import orchestrator_pb2 as opb
from specdec.v1 import orchestrator_pb2_grpc

PROMPT = "the quick brown fox"


def _creds(pki, *, cert: bool = True, ca=None):
    ca = (ca or pki.ca).read_bytes()
    if not cert:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes())


def _service_stub(secured, role: str, creds):
    channel = grpc.secure_channel(secured.address(role), creds) if creds else \
        grpc.insecure_channel(secured.address(role))
    cls = model_pb2_grpc.TargetServiceStub if role == "target" else model_pb2_grpc.DraftServiceStub
    return channel, cls(channel)


def test_generate_over_tls_with_a_token(secured) -> None:
    with Client(secured.address("orch"), token=secured.tokens["alice"], ca=str(secured.pki.ca),
                timeout=60) as c:
        done = c.complete(PROMPT, max_new_tokens=8)
    assert done.stats.new_tokens == 8 and done.text


@pytest.mark.parametrize("hop", ["orch", "target", "draft"])
def test_a_plaintext_client_fails_on_every_hop(secured, hop: str) -> None:
    with grpc.insecure_channel(secured.address(hop)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_fails(secured) -> None:
    with grpc.secure_channel(secured.address("orch"), _creds(secured.pki, cert=False,
                                                            ca=secured.pki.other_ca)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_orchestrator_tokens(secured) -> None:
    address, ca = secured.address("orch"), str(secured.pki.ca)
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                        ("not-a-token-of-anyone", grpc.StatusCode.PERMISSION_DENIED)):
        with Client(address, token=token, ca=ca, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.complete(PROMPT, max_new_tokens=2)
            assert err.value.code() == code
            assert dict(err.value.trailing_metadata())["x-request-id"]
            with pytest.raises(grpc.RpcError) as err:
                c.check(PROMPT, " jumps")
            assert err.value.code() == code
            with pytest.raises(grpc.RpcError) as err:
                c.end_session("0" * 32)
            assert err.value.code() == code
    # A malformed header is "missing", not a lookup.
    with Client(address, ca=ca, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.complete(PROMPT, max_new_tokens=2, metadata=(("authorization", "Basic abc"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open(secured) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.secure_channel(secured.address("orch"), _creds(secured.pki, cert=False)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "specdec.v1.Orchestrator" in names


@pytest.mark.parametrize("role", ["target", "draft"])
def test_model_services_accept_only_orchestrators(secured, role: str) -> None:
    pki = secured.pki
    # No client certificate, or one from a CA the service does not trust: no handshake.
    for creds in (_creds(pki, cert=False),
                  grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.stranger_key.read_bytes(),
                                               pki.stranger_cert.read_bytes())):
        channel, stub = _service_stub(secured, role, creds)
        with channel, pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(common_pb2.GetInfoRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # The orchestrators' certificate but no / a wrong service token.
    channel, stub = _service_stub(secured, role, _creds(pki))
    verb = stub.Score if role == "target" else stub.Propose
    request = (model_pb2.ScoreRequest if role == "target" else model_pb2.ProposeRequest)(
        session_id="someone-else", tokens=[1, 2, 3], k=0 if role == "target" else 1)
    with channel:
        for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", "Bearer guess-guess-guess"),),
                                grpc.StatusCode.PERMISSION_DENIED)):
            for call, req in ((verb, request), (stub.Release, common_pb2.ReleaseRequest(session_id="x")),
                              (stub.GetInfo, common_pb2.GetInfoRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=5, metadata=metadata)
                assert err.value.code() == code
        ok = (("authorization", f"Bearer {secured.service_token}"),)
        assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5, metadata=ok).role == role


def test_undecodable_bytes_are_invalid_argument(secured) -> None:
    with grpc.secure_channel(secured.address("orch"), _creds(secured.pki, cert=False)) as channel:
        raw = channel.unary_unary("/specdec.v1.Orchestrator/Check")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\x0a\x02\xff\xfe", timeout=5,  # field 1 (prompt): invalid UTF-8
                metadata=(("authorization", f"Bearer {secured.tokens['alice']}"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Error" not in err.value.details()


def test_non_loopback_bind_needs_tls_tokens_or_insecure(tiny_pair, tmp_path) -> None:
    port = procs.free_port()
    argv = service_argv("target", port, model=tiny_pair[0], threads=1, extra=("--host", "0.0.0.0"))
    proc = procs.start(argv, log_path=tmp_path / "refused.log")
    assert proc.wait(timeout=120) != 0
    assert "refusing to bind 0.0.0.0" in (tmp_path / "refused.log").read_text()
    argv = service_argv("target", port, model=tiny_pair[0], threads=1,
                        extra=("--host", "0.0.0.0", "--insecure"))
    proc = procs.start(argv, log_path=tmp_path / "insecure.log")
    try:
        procs.wait_healthy(f"127.0.0.1:{port}", proc, timeout=120)
        assert "with neither TLS nor tokens (--insecure)" in (tmp_path / "insecure.log").read_text()
    finally:
        procs.stop(proc)

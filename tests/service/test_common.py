"""What both services share: GetInfo, health, reflection, --help, shutdown."""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine.model.loader import tokenizer_fingerprint
from specdec.runtime.launch import device_under_test
from specdec.v1 import common_pb2
from tests.service.conftest import MAX_K, ROOT


@pytest.fixture(params=["target", "draft"])
def service(request):
    return request.getfixturevalue(request.param)


def test_get_info(service, tokenizer, reference) -> None:
    info = service.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    model = reference[0] if service.role == "target" else reference[1]
    assert info.role == service.role
    assert info.model_name == service.role  # the tiny pair's folder names
    assert info.vocab_size == 384
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert list(info.eos_token_ids) == [tokenizer.eos_token_id]
    assert info.context_length == 512
    assert (info.device, info.dtype) == (device_under_test() or "cpu", "float32")
    assert info.parameter_count == sum(p.numel() for p in model.parameters())
    assert info.max_k == MAX_K[service.role]
    assert info.replica_id.endswith(f":{service.port}")


def test_health_and_reflection(service) -> None:
    health = health_pb2_grpc.HealthStub(service.channel)
    name = f"specdec.v1.{service.role.capitalize()}Service"
    for svc in ("", name):
        reply = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    db = ProtoReflectionDescriptorDatabase(service.channel)
    assert name in set(db.get_services())
    # What grpcurl does: resolve the service and list its methods.
    from google.protobuf.descriptor_pool import DescriptorPool

    pool = DescriptorPool(db)
    methods = {m.name for m in pool.FindServiceByName(name).methods}
    verb = "Score" if service.role == "target" else "Propose"
    assert methods == {verb, f"{verb}Batch", f"{verb}Stream", "Release", "GetInfo", "Fork"}


def test_release_requires_a_session_id(service) -> None:
    with pytest.raises(grpc.RpcError) as info:
        service.stub.Release(common_pb2.ReleaseRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session_id" in info.value.details()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_help(role: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", f"{role}_service", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--device", "--dtype", "--threads", "--port", "--max-sessions",
                 "--cache-budget-mb", "--metrics-port", "SPECDEC_MODEL"):
        assert flag in out.stdout


def test_bad_model_path_fails_fast(services, tmp_path) -> None:
    from specdec.runtime.procs import ServiceDied

    with pytest.raises(ServiceDied, match="expected a local Hugging Face folder"):
        services("target", tmp_path / "nothing-here", timeout=60)


def test_environment_variables_configure_a_service(services, tiny_pair) -> None:
    env = {"SPECDEC_MODEL": str(tiny_pair[1]), "SPECDEC_MAX_K": "5",
           "SPECDEC_REPLICA_ID": "draft-from-env", "SPECDEC_NUM_LAYERS": "1"}
    svc = services("draft", None, env=env)
    info = svc.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.model_name == "draft:early-exit-1of2"
    assert (info.max_k, info.replica_id) == (5, "draft-from-env")

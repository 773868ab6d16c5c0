"""Roles that cannot impersonate each other, with real processes and real certificates.

A `specdec secrets` folder gives each role only its own files: model services hold server
certificates and the service token's SHA-256, never a client certificate or the token. The
model services accept only the orchestrators' certificate (spiffe://specdec/orchestrator):
a model pod's own credentials do not even complete the handshake, and a certificate the CA
signed for anyone else (the old single server certificate, valid for client use, with the
real service token) is PERMISSION_DENIED on Score, Fork and Propose. Rotation keeps the old
secrets accepted until --drop-previous. The interceptor refuses every handler shape it has
no wrapper for, and the generated redis.conf gives model services the registry keys alone.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from specdec.runtime import procs
from specdec.runtime.credentials import drop_previous, generate, rotate, rotate_ca
from specdec.runtime.errors import ErrorInterceptor
from specdec.runtime.launch import Processes, child_env, service_argv
from specdec.runtime.security import BearerGuard, TokenTable
from specdec.v1 import common_pb2, model_pb2, model_pb2_grpc
from tests.security.conftest import wait_listening

DENIED = grpc.StatusCode.PERMISSION_DENIED


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@dataclass(frozen=True)
class Caller:
    """What one party holds: a client certificate (or none) and a bearer token (or none)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    token: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    @property
    def metadata(self):
        return (("authorization", f"Bearer {self.token}"),) if self.token else None


def orchestrator_caller(secrets: Path) -> Caller:
    own = secrets / "orchestrator"
    token = _env_file(own / "orchestrator.env")["SPECDEC_SERVICE_TOKEN"]
    return Caller((own / "ca.crt").read_bytes(), (own / "client.crt").read_bytes(),
                  (own / "client.key").read_bytes(), token)


def old_layout_caller(secrets: Path, token: str) -> Caller:
    """The single certificate every host had before roles: server and client use, signed by the
    deployment's CA but naming no orchestrator (what a compromised model pod held)."""
    from specdec.runtime.credentials import _cert, _key, _pem_cert, _pem_key, _signing_ca

    ca, ca_key = _signing_ca(secrets)
    key = _key()
    cert = _cert("specdec server", key, ca.subject, ca_key, ca=False, client=True,
                 sans=["localhost", "127.0.0.1", "target", "draft"])
    return Caller((secrets / "ca.crt").read_bytes(), _pem_cert(cert), _pem_key(key), token)


# ------------------------------------------------------------------ the secrets layout


def test_each_role_holds_only_its_own_files(tmp_path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    secrets = tmp_path / "secrets"
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "secrets", str(secrets)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    files = {p.parent.name: set() for p in secrets.glob("*/*")}
    for p in secrets.glob("*/*"):
        files[p.parent.name].add(p.name)
    assert files == {
        "orchestrator": {"ca.crt", "server.crt", "server.key", "client.crt", "client.key", "tokens",
                         "orchestrator.env"},
        "target": {"ca.crt", "server.crt", "server.key", "model.env"},
        "draft": {"ca.crt", "server.crt", "server.key", "model.env"},
        "redis": {"ca.crt", "server.crt", "server.key", "redis.conf"},
        "gateway": {"ca.crt"},
    }
    assert oct(secrets.stat().st_mode & 0o777) == "0o700"
    assert oct((secrets / "ca.key").stat().st_mode & 0o777) == "0o600"
    token = _env_file(secrets / "orchestrator" / "orchestrator.env")["SPECDEC_SERVICE_TOKEN"]
    from specdec.runtime.security import token_sha256

    for role in ("target", "draft", "redis", "gateway"):
        for path in (secrets / role).iterdir():
            assert token not in path.read_text(), path  # only the orchestrators hold the token
    for role in ("target", "draft"):
        env = _env_file(secrets / role / "model.env")
        assert env["SPECDEC_SERVICE_TOKEN_SHA256"] == token_sha256(token)
        assert env["SPECDEC_REDIS_USERNAME"] == role  # each role its own Redis user

    def usage(path: Path) -> set:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    for role in ("orchestrator", "target", "draft", "redis"):
        assert usage(secrets / role / "server.crt") == {ExtendedKeyUsageOID.SERVER_AUTH}, role
    assert usage(secrets / "orchestrator" / "client.crt") == {ExtendedKeyUsageOID.CLIENT_AUTH}
    names = x509.load_pem_x509_certificate((secrets / "target" / "server.crt").read_bytes()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "target" in names and "draft" not in names and "orchestrator" not in names


def test_rotation_accepts_the_previous_generation_until_it_is_dropped(tmp_path) -> None:
    secrets = tmp_path / "secrets"
    generate(secrets)
    first = _env_file(secrets / "target" / "model.env")["SPECDEC_SERVICE_TOKEN_SHA256"]
    first_conf = (secrets / "redis" / "redis.conf").read_text()
    rotate(secrets)
    accepted = _env_file(secrets / "target" / "model.env")["SPECDEC_SERVICE_TOKEN_SHA256"].split(",")
    assert len(accepted) == 2 and accepted[1] == first
    conf = (secrets / "redis" / "redis.conf").read_text()
    old_hash = first_conf.split("user target on #", 1)[1].split()[0]
    assert f"#{old_hash}" in conf.split("user target on", 1)[1].split("~", 1)[0]
    rotate_ca(secrets)
    assert (secrets / "gateway" / "ca.crt").read_text().count("BEGIN CERTIFICATE") == 2
    drop_previous(secrets)
    assert _env_file(secrets / "target" / "model.env")["SPECDEC_SERVICE_TOKEN_SHA256"] == accepted[0]
    assert (secrets / "gateway" / "ca.crt").read_text().count("BEGIN CERTIFICATE") == 1
    assert old_hash not in (secrets / "redis" / "redis.conf").read_text()
    with pytest.raises(FileExistsError):
        generate(secrets)


def test_a_folder_with_the_shared_model_user_keeps_it_until_drop_previous(tmp_path) -> None:
    """Folders written before each role had its own Redis user: --rotate writes the role users and
    keeps the old shared one (running services still log in with it); --drop-previous removes it."""
    import hashlib
    import json

    secrets = tmp_path / "secrets"
    generate(secrets)
    state = json.loads((secrets / "state.json").read_text())
    digest = hashlib.sha256(b"old-model-password").hexdigest()
    state["redis"] = {"orchestrator": state["redis"]["orchestrator"],
                      "model": {"password": "old-model-password", "sha256": [digest]}}
    (secrets / "state.json").write_text(json.dumps(state))
    rotate(secrets)
    conf = (secrets / "redis" / "redis.conf").read_text()
    assert f"user model on #{digest} " in conf
    assert "user target on " in conf and "user draft on " in conf
    assert _env_file(secrets / "draft" / "model.env")["SPECDEC_REDIS_USERNAME"] == "draft"
    drop_previous(secrets)
    assert "user model " not in (secrets / "redis" / "redis.conf").read_text()


def test_a_folder_of_the_single_certificate_layout_is_replaced_whole(tmp_path) -> None:
    old = tmp_path / "secrets"
    old.mkdir()
    for name in ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key",
                 "tokens", "specdec.env", "redis.conf"):
        (old / name).write_text("old")
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "secrets", str(old), "--rotate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--force replaces them" in out.stderr
    generate(old, force=True)
    assert sorted(p.name for p in old.iterdir() if p.is_file()) == ["ca.crt", "ca.key", "state.json"]


# ------------------------------------------------------------------ real model services


@dataclass
class Services:
    secrets: Path
    group: Processes
    addresses: dict[str, str]
    health_ports: dict[str, int]
    models: dict[str, Path]

    def start(self, role: str) -> None:
        own = self.secrets / role
        port, health = procs.free_port(), procs.free_port()
        argv = service_argv(role, port, model=self.models[role], threads=1, replica_id=role, extra=(
            "--tls-cert", str(own / "server.crt"), "--tls-key", str(own / "server.key"),
            "--tls-client-ca", str(own / "ca.crt"), "--health-port", str(health)))
        # The digest and Redis login come from the role's env file, as compose and k8s give them.
        proc = self.group.start(role, argv, env=_env_file(own / "model.env"))
        procs.wait_healthy(f"127.0.0.1:{health}", proc, timeout=120)  # plaintext, loopback only
        self.addresses[role] = f"127.0.0.1:{port}"
        self.health_ports[role] = health

    def restart(self, role: str) -> None:
        self.group.stop(role)
        self.start(role)


@pytest.fixture(scope="module")
def services(tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("roles")
    generate(folder / "secrets", hosts=["localhost"])
    s = Services(folder / "secrets", Processes(folder, env=child_env(1, quiet=True)), {}, {},
                 dict(zip(("target", "draft"), tiny_pair)))
    try:
        for role in ("target", "draft"):
            s.start(role)
        yield s
    finally:
        s.group.stop_all()


def _stub(services: Services, role: str, caller: Caller):
    channel = grpc.secure_channel(services.addresses[role], caller.credentials(),
                                  options=[("grpc.ssl_target_name_override", "localhost")])
    cls = model_pb2_grpc.TargetServiceStub if role == "target" else model_pb2_grpc.DraftServiceStub
    return channel, cls(channel)


def _verbs(stub, role: str):
    """(name, call, request) for each verb a caller could use to read another session."""
    fork = model_pb2.ForkRequest(session_id="someone-else", new_session_id="mine", length=2)
    if role == "target":
        return [("Score", stub.Score, model_pb2.ScoreRequest(session_id="probe", tokens=[1, 2, 3], k=0)),
                ("Fork", stub.Fork, fork)]
    return [("Propose", stub.Propose, model_pb2.ProposeRequest(session_id="probe", tokens=[1, 2, 3], k=1)),
            ("Fork", stub.Fork, fork)]


def _codes(services: Services, role: str, caller: Caller) -> dict[str, grpc.StatusCode]:
    channel, stub = _stub(services, role, caller)
    codes = {}
    with channel:
        for name, call, request in _verbs(stub, role):
            try:
                call(request, timeout=20, metadata=caller.metadata)
                codes[name] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[name] = exc.code()
    return codes


def test_the_orchestrators_credentials_pass(services) -> None:
    caller = orchestrator_caller(services.secrets)
    for role in ("target", "draft"):
        codes = _codes(services, role, caller)
        first = "Score" if role == "target" else "Propose"
        assert codes[first] == grpc.StatusCode.OK, codes
        assert codes["Fork"] not in (DENIED, grpc.StatusCode.UNAUTHENTICATED), codes  # no such source


@pytest.mark.parametrize("own,other", [("draft", "target"), ("target", "draft")])
def test_a_model_pods_credentials_cannot_call_the_other_model_service(services, own, other) -> None:
    mine = services.secrets / own
    assert not (mine / "client.key").exists() and "SPECDEC_SERVICE_TOKEN" not in _env_file(mine / "model.env")
    # Its own certificate is for server use only: the handshake refuses it as a client's.
    pod = Caller((mine / "ca.crt").read_bytes(), (mine / "server.crt").read_bytes(),
                 (mine / "server.key").read_bytes())
    assert set(_codes(services, other, pod).values()) == {grpc.StatusCode.UNAVAILABLE}
    # A certificate the CA signed for client use that names no orchestrator (the single
    # certificate of the old layout), even with the real service token: PERMISSION_DENIED.
    token = orchestrator_caller(services.secrets).token
    codes = _codes(services, other, old_layout_caller(services.secrets, token))
    print(f"\n{own} pod credentials -> {other}: {({k: v.name for k, v in codes.items()})}")
    assert set(codes.values()) == {DENIED}, codes


def test_the_health_port_serves_health_alone_on_loopback(services) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{services.health_ports['target']}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            model_pb2_grpc.TargetServiceStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_rotation_with_real_processes(services) -> None:
    """--rotate: a restarted service takes the old and the new orchestrator credentials;
    --drop-previous: only the new ones."""
    before = orchestrator_caller(services.secrets)
    rotate(services.secrets, hosts=["localhost"])
    after = orchestrator_caller(services.secrets)
    assert after.token != before.token and after.cert != before.cert
    services.restart("target")
    assert _codes(services, "target", before)["Score"] == grpc.StatusCode.OK
    assert _codes(services, "target", after)["Score"] == grpc.StatusCode.OK
    drop_previous(services.secrets)
    services.restart("target")
    assert _codes(services, "target", before)["Score"] == DENIED  # the old token
    assert _codes(services, "target", after)["Score"] == grpc.StatusCode.OK


# ------------------------------------------------------------------ a new CA, in-process


async def _health_status(port: int, caller: Caller) -> grpc.StatusCode:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.ssl_target_name_override", "localhost")]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", caller.credentials(), options) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


async def _serve_target_files(secrets: Path, callers: list[Caller]) -> list[grpc.StatusCode]:
    """A TLS server with the target's files (mutual TLS against its bundle); each caller's status."""
    from grpc_health.v1 import health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    own = secrets / "target"
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [((own / "server.key").read_bytes(), (own / "server.crt").read_bytes())],
        root_certificates=(own / "ca.crt").read_bytes(), require_client_auth=True))
    await server.start()
    try:
        return [await _health_status(port, c) for c in callers]
    finally:
        await server.stop(0)


def test_a_new_ca_is_trusted_beside_the_old_one_until_dropped(tmp_path) -> None:
    secrets = tmp_path / "secrets"
    generate(secrets, hosts=["localhost"])
    before = orchestrator_caller(secrets)
    rotate_ca(secrets)  # every process restarts trusting both CAs; the leaves stay as they were
    old = orchestrator_caller(secrets)
    assert (old.cert, old.token) == (before.cert, before.token) and old.ca != before.ca
    rotate(secrets, hosts=["localhost"])  # leaves from the new CA
    new = orchestrator_caller(secrets)
    ok = grpc.StatusCode.OK
    assert asyncio.run(_serve_target_files(secrets, [old, new])) == [ok, ok]
    drop_previous(secrets)
    assert asyncio.run(_serve_target_files(secrets, [old, new])) == [grpc.StatusCode.UNAVAILABLE, ok]


# ------------------------------------------------------------------ the interceptor fails closed


def _identity(b: bytes) -> bytes:
    return b


async def _unary(request, context):
    return b"ran"


async def _server_stream(request, context):
    yield b"ran"


async def _written_stream(request, context):  # the health Watch's shape: context.write
    await context.write(b"ran")


async def _client_stream(requests, context):
    async for _ in requests:
        pass
    return b"ran"


async def _bidi(requests, context):
    async for _ in requests:
        yield b"ran"


SHAPES = {
    "Unary": (grpc.unary_unary_rpc_method_handler, _unary, "unary_unary"),
    "ServerStream": (grpc.unary_stream_rpc_method_handler, _server_stream, "unary_stream"),
    "Written": (grpc.unary_stream_rpc_method_handler, _written_stream, "unary_stream"),
    "ClientStream": (grpc.stream_unary_rpc_method_handler, _client_stream, "stream_unary"),
    "Bidi": (grpc.stream_stream_rpc_method_handler, _bidi, "stream_stream"),
}


async def _call_every_shape(metadata) -> dict[str, str]:
    guard = BearerGuard(TokenTable({"t" * 20: "alice"}))
    server = grpc.aio.server(interceptors=[ErrorInterceptor(guard=guard)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Shapes", {
        name: make(fn, _identity, _identity) for name, (make, fn, _) in SHAPES.items()}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for name, (_, _, shape) in SHAPES.items():
                call = getattr(channel, shape)(f"/test.Shapes/{name}", _identity, _identity)
                request = b"x" if shape.startswith("unary") else iter([b"x"])
                try:
                    if shape.endswith("stream"):
                        got = [r async for r in call(request, timeout=10, metadata=metadata)]
                    else:
                        got = [await call(request, timeout=10, metadata=metadata)]
                    out[name] = "OK" if got == [b"ran"] else f"got {got}"
                except grpc.aio.AioRpcError as exc:
                    out[name] = exc.code().name
    finally:
        await server.stop(0)
    return out


def test_the_interceptor_guards_every_handler_shape() -> None:
    assert asyncio.run(_call_every_shape(None)) == {name: "UNAUTHENTICATED" for name in SHAPES}
    wrong = (("authorization", "Bearer " + "u" * 20),)
    assert asyncio.run(_call_every_shape(wrong)) == {name: "PERMISSION_DENIED" for name in SHAPES}
    right = (("authorization", "Bearer " + "t" * 20),)
    assert asyncio.run(_call_every_shape(right)) == {name: "OK" for name in SHAPES}


# ------------------------------------------------------------------ Redis users


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """redis-server with the generated redis.conf (its port and file paths moved for the test)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    folder = tmp_path_factory.mktemp("acl")
    generate(folder / "secrets", hosts=["localhost"])
    own = folder / "secrets" / "redis"
    port = procs.free_port()
    proc = subprocess.Popen(
        ["redis-server", str(own / "redis.conf"), "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(own / "server.crt"), "--tls-key-file", str(own / "server.key"),
         "--tls-ca-cert-file", str(own / "ca.crt"), "--save", "", "--appendonly", "no",
         "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port, proc)
    yield folder / "secrets", f"rediss://localhost:{port}/0?ssl_ca_certs={own / 'ca.crt'}"
    proc.terminate()
    proc.wait(timeout=10)


async def _as_role(url: str, env: dict[str, str], role: str = "target") -> dict[str, str]:
    """What a role's Redis login may do: register a replica of `role`, read the registry, read a session."""
    from specdec.runtime.store import ServiceEntry, ServiceRegistry, SessionStore, StoreUnavailable, connect

    saved = {k: os.environ.get(k) for k in ("SPECDEC_REDIS_USERNAME", "SPECDEC_REDIS_PASSWORD")}
    os.environ.update({k: env[k] for k in saved})
    client = connect(url)
    out = {}
    try:
        registry = ServiceRegistry(client, url=url)
        for name, step in (
                ("register", lambda: registry.register(ServiceEntry("h:1", role, "t1", "m", "f"))),
                ("list", lambda: registry.live(role)),
                ("read session", lambda: SessionStore(client, url=url).load("someone")),
                ("deregister", lambda: registry.deregister(role, "t1"))):
            try:
                await step()
                out[name] = "ok"
            except StoreUnavailable:
                out[name] = "refused"
    finally:
        await client.aclose()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return out


def test_model_services_may_write_only_the_registry(acl_redis) -> None:
    secrets, url = acl_redis
    for role, other in (("target", "draft"), ("draft", "target")):
        env = _env_file(secrets / role / "model.env")
        own = asyncio.run(_as_role(url, env, role))
        assert own == {"register": "ok", "list": "refused", "read session": "refused", "deregister": "ok"}, role
        # Another role's keys: a draft pod cannot announce a target (nor remove one), and back.
        assert asyncio.run(_as_role(url, env, other)) == {
            "register": "refused", "list": "refused", "read session": "refused", "deregister": "refused"}, role
    orchestrator = asyncio.run(_as_role(url, _env_file(secrets / "orchestrator" / "orchestrator.env")))
    assert set(orchestrator.values()) == {"ok"}
    assert asyncio.run(_as_role(url, {"SPECDEC_REDIS_USERNAME": "default",
                                      "SPECDEC_REDIS_PASSWORD": "x"}))["register"] == "refused"

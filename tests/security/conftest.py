"""A secured stack: TLS on every hop, mutual TLS + a service token to the model services,
tenant tokens on the orchestrator; certificates from a throwaway `specdec secrets` folder (and a
trustme CA nobody trusts)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

from specdec.runtime import procs
from specdec.runtime.launch import orchestrator_argv, service_argv
from tests.integration.stack import Stack

TENANTS = ("alice", "bob", "carol", "dave", "erin")


@dataclass(frozen=True)
class Pki:
    ca: Path  # trusted by every client
    server_cert: Path
    server_key: Path
    client_cert: Path  # the orchestrator's, for mutual TLS to the services
    client_key: Path
    other_ca: Path  # a CA nobody trusts
    stranger_cert: Path  # a client certificate from other_ca
    stranger_key: Path
    secrets: Path  # the `specdec secrets` folder all but the stranger's come from


def _pair(cert, folder: Path, name: str) -> tuple[Path, Path]:
    crt, key = folder / f"{name}.crt", folder / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(crt))
    cert.private_key_pem.write_to_path(str(key))
    return crt, key


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    """The orchestrator's files of a `specdec secrets` folder (its server certificate names
    localhost and 127.0.0.1, so every server of the stack presents it), plus a stranger."""
    import trustme

    from specdec.runtime.credentials import generate

    folder = tmp_path_factory.mktemp("pki")
    generate(folder / "secrets")
    mine = folder / "secrets" / "orchestrator"
    other = trustme.CA()
    other.cert_pem.write_to_path(str(folder / "other-ca.crt"))
    stranger = _pair(other.issue_cert("stranger"), folder, "stranger")
    return Pki(mine / "ca.crt", mine / "server.crt", mine / "server.key", mine / "client.crt",
               mine / "client.key", folder / "other-ca.crt", *stranger, folder / "secrets")


@dataclass
class Secured:
    stack: Stack
    pki: Pki
    tokens: dict[str, str]  # tenant -> token
    service_token: str
    metrics_port: int

    def address(self, name: str) -> str:
        return self.stack.addresses[name]


def server_tls(pki: Pki, *, mutual: bool, role: str = "orchestrator") -> tuple[str, ...]:
    """A server's TLS flags, with its role's certificate (which names the role: spiffe://specdec/ROLE)."""
    own = pki.secrets / role
    flags = ("--tls-cert", str(own / "server.crt"), "--tls-key", str(own / "server.key"))
    return flags + (("--tls-client-ca", str(pki.ca)) if mutual else ())


@pytest.fixture(scope="session")
def secured(tiny_pair, pki, tmp_path_factory) -> Secured:
    target_dir, draft_dir = tiny_pair
    logs = tmp_path_factory.mktemp("secured")
    tokens = {t: secrets.token_urlsafe(24) for t in TENANTS}
    (logs / "tokens").write_text("# tenant:token\n" + "".join(f"{t}:{k}\n" for t, k in tokens.items()))
    service_token = secrets.token_urlsafe(24)
    s = Stack(logs=logs)
    metrics_port = procs.free_port()
    try:
        for role, model in (("target", target_dir), ("draft", draft_dir)):
            port = procs.free_port()
            service = (*server_tls(pki, mutual=True, role=role), f"--service-token={service_token}")
            argv = service_argv(role, port, model=model, threads=1, replica_id=role, extra=service)
            s.processes.start(role, argv)
            s.addresses[role] = f"127.0.0.1:{port}"
        port = procs.free_port()
        argv = orchestrator_argv(
            port, tokenizer=target_dir, targets=[s.addresses["target"]], drafts=[s.addresses["draft"]],
            redis_url=s.redis_url, redis_prefix=s.prefix, metrics_port=metrics_port,
            extra=("--startup-timeout", "60", *server_tls(pki, mutual=False),
                   "--auth-tokens", str(logs / "tokens"),
                   "--service-tls-ca", str(pki.ca), "--service-tls-cert", str(pki.client_cert),
                   "--service-tls-key", str(pki.client_key), f"--service-token={service_token}",
                   "--max-request-bytes", "65536", "--max-streams-per-tenant", "2",
                   "--rate-per-tenant", "4", "--burst-per-tenant", "8"))
        s.processes.start("orch", argv)
        s.addresses["orch"] = f"127.0.0.1:{port}"
        for name in ("target", "draft", "orch"):
            wait_serving(s.addresses[name], pki, s.processes.running[name])
        yield Secured(s, pki, tokens, service_token, metrics_port)
    finally:
        s.stop()


def wait_serving(address: str, pki: Pki, proc, timeout: float = 120.0) -> None:
    """grpc.health.v1 over TLS (with the client certificate, which mutual-TLS servers need)."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                         pki.client_cert.read_bytes())
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(address, creds, options=procs.POLL_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{address} exited: {procs.log_tail(proc)}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING: {procs.log_tail(proc)}")
            time.sleep(0.2)


def wait_listening(port: int, proc, timeout: float = 60.0) -> None:
    """Until something accepts TCP connections on 127.0.0.1:`port` (a redis-server started as
    `proc`, which binds its TLS port only once its certificates are loaded): no fixed sleep."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server on port {port} exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listening on port {port} after {timeout:.0f} s"
            time.sleep(0.05)

"""A replica is routed to as a role only if its certificate names that role (real processes, TLS).

A compromised draft pod holds the draft's certificate and the service token's digest. Run as a
target (and announced as one), it would see every tenant's prompt and choose every output. The
orchestrator reads each replica's certificate before it routes to it: an impostor target whose
certificate names spiffe://specdec/draft is never used; here it is the only target listed, so
the orchestrator finds none and says why. `--service-role-id ''` (the check off) is the control:
the same orchestrator then serves through it.
"""
from __future__ import annotations

from specdec.runtime import procs
from specdec.runtime.launch import child_env, orchestrator_argv, service_argv
from tests.security.conftest import server_tls, wait_serving


def _orchestrator(secured, tokenizer, target: str, logs, extra: tuple[str, ...] = ()):
    """(process, port) of a plaintext orchestrator calling `target` over the services' TLS."""
    pki = secured.pki
    port = procs.free_port()
    argv = orchestrator_argv(port, tokenizer=tokenizer, targets=[target], redis_prefix=secured.stack.prefix,
                             extra=("--startup-timeout", "5", "--service-tls-ca", str(pki.ca),
                                    "--service-tls-cert", str(pki.client_cert),
                                    "--service-tls-key", str(pki.client_key),
                                    f"--service-token={secured.service_token}", *extra))
    return procs.start(argv, env=child_env(1, quiet=True), log_path=logs), port


def test_a_target_whose_certificate_names_another_role_is_never_routed_to(secured, tiny_pair, tmp_path) -> None:
    target_dir, _ = tiny_pair
    port = procs.free_port()
    impostor = procs.start(service_argv("target", port, model=target_dir, threads=1, replica_id="impostor", extra=(
        *server_tls(secured.pki, mutual=True, role="draft"), f"--service-token={secured.service_token}")),
        env=child_env(1, quiet=True), log_path=tmp_path / "impostor.log")
    try:
        wait_serving(f"127.0.0.1:{port}", secured.pki, impostor)
        checked, _ = _orchestrator(secured, target_dir, f"127.0.0.1:{port}", tmp_path / "checked.log")
        assert checked.wait(timeout=120) == 2, procs.log_tail(checked)
        log = (tmp_path / "checked.log").read_text()
        assert "no target service answered GetInfo" in log, log[-2000:]
        assert "spiffe://specdec/draft" in log and "not spiffe://specdec/target" in log, log[-2000:]
        # The control: with the check off, the same orchestrator takes the impostor as its target.
        unchecked, oport = _orchestrator(secured, target_dir, f"127.0.0.1:{port}", tmp_path / "unchecked.log",
                                         ("--service-role-id", ""))
        try:
            procs.wait_healthy(f"127.0.0.1:{oport}", unchecked, timeout=120)
        finally:
            procs.stop(unchecked)
    finally:
        procs.stop(impostor)

"""python -m launcher.healthcheck: the image's HEALTHCHECK, for whichever specdec process the container runs.

One image runs every role, so the check looks at the container's main process (PID 1's command
line; `sh -c 'exec python -m ...'` has exec'd into it) and its SPECDEC_* environment:

    gateway                      GET http://127.0.0.1:PORT/health (200 while its orchestrator serves)
    target_service, draft_service  grpc.health.v1 on the loopback health port (--health-port), else
                                 on PORT (which then must not require a client certificate)
    orchestrator                 grpc.health.v1 on PORT, over TLS with SPECDEC_TLS_CA if set
    anything else                healthy (a one-off command such as `specdec --help`)

Exit 0 when healthy, 1 when not. compose.yaml and the Kubernetes probes name their own checks
(`specdec health ...`, the gateway's /health); this is for a plain `docker run`.
"""
from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence

DEFAULT_PORTS = {"gateway": 8000, "target_service": 50061, "draft_service": 50062, "orchestrator": 50050}


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in argv (the last one wins, as argparse does)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def role_of(argv: Sequence[str]) -> str | None:
    """`python -m ROLE ...`: the role, if it is one of specdec's processes."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in DEFAULT_PORTS:
            return argv[i + 1]
    return None


def check_of(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, str] | None:
    """("http", url) or ("grpc", host:port) to check for a process started as `argv`; None: nothing."""
    role = role_of(argv)
    if role is None:
        return None
    port = _flag(argv, "--port") or env.get("SPECDEC_PORT") or str(DEFAULT_PORTS[role])
    if role == "gateway":
        return "http", f"http://127.0.0.1:{port}/health"
    if role in ("target_service", "draft_service"):
        health = _flag(argv, "--health-port") or env.get("SPECDEC_HEALTH_PORT") or "0"
        if health != "0":
            port = health
    return "grpc", f"127.0.0.1:{port}"


def main_argv() -> list[str]:
    with open("/proc/1/cmdline", "rb") as f:
        return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]


def main(argv: Sequence[str] | None = None) -> int:
    check = check_of(main_argv() if argv is None else argv, os.environ)
    if check is None:
        return 0
    kind, where = check
    if kind == "http":
        try:
            with urllib.request.urlopen(where, timeout=4) as reply:
                return 0 if reply.status == 200 else 1
        except OSError as exc:  # URLError / HTTPError (a 503 while the orchestrator is not serving)
            print(f"{where}: {exc}", file=sys.stderr)
            return 1
    from launcher.cli import main as cli  # `specdec health`: SPECDEC_TLS_CA etc. from the environment

    return cli(["health", where, "--timeout", "4"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or None))

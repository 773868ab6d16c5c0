"""The gateway's settings (python -m gateway), defined once."""
from __future__ import annotations

from specdec.settings import CLIENT_TLS, ON, Flag, Group, Settings

GATEWAY = Group("gateway", (
    Flag("orchestrator", "orchestrator gRPC address", "127.0.0.1:50050"),
    Flag("host", "address to bind (0.0.0.0 for all interfaces)", "127.0.0.1"),
    Flag("port", "HTTP port", 8000, int, env_aliases=("SPECDEC_GATEWAY_PORT",)),
    Flag("model-name", "model id listed by /v1/models; requests must name it", "specdec"),
    Flag("default-max-tokens", "max_tokens when a request gives none", 256, int),
    Flag("request-timeout", "seconds one generation may take", 600.0, float),
    Flag("grace", "seconds open streams get to finish on SIGTERM", 10.0, float),
    Flag("no-playground", "do not serve the playground page at /playground", False, kind=ON),
    Flag("playground-passes-per-minute", "pass quota: target passes per visitor (client address) per "
         "minute on the playground, 0 = none", 30, int),
    Flag("log-level", "DEBUG, INFO, WARNING...", "INFO"),
))
ORCHESTRATOR_TLS = Group("calls to the orchestrator", CLIENT_TLS)


def gateway_settings(description: str) -> Settings:
    return Settings(prog="python -m gateway", description=description, groups=(GATEWAY, ORCHESTRATOR_TLS))

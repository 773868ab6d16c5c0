"""The gateway's settings (python -m gateway), defined once."""
from __future__ import annotations

from gateway.guard import LOCAL_HOSTS
from gateway.responses.kept import RECORD_TTL_S
from specdec.runtime.settings import CLIENT_TLS, ON, SWITCH, Flag, Group, Settings

GATEWAY = Group("gateway", (
    Flag("orchestrator", "orchestrator gRPC address; several, comma-separated: orchestrator processes "
         "over one fleet (see --spread)", "127.0.0.1:50050"),
    Flag("spread", "with several --orchestrator addresses: each new stream starts on the next one in "
         "turn, a broken one resuming on the one after its own (--no-spread: every stream to the "
         "first that answers, the next taking over when it fails)", True, kind=SWITCH),
    Flag("multiplex", "run the generations to each orchestrator over one shared GenerateMany stream, their "
         "chunks packed into one message per moment (--no-multiplex: a Generate stream each; an "
         "orchestrator without GenerateMany gets those anyway)", True, kind=SWITCH),
    Flag("host", "address to bind (0.0.0.0 for all interfaces)", "127.0.0.1"),
    Flag("port", "HTTP port", 8000, int, env_aliases=("SPECDEC_GATEWAY_PORT",)),
    Flag("served-model-name", "the model ids requests may name, comma-separated: the first is the one "
         "/v1/models lists first and responses report, the others aliases ('specdec' is always one); "
         "empty = the target's own name (its model folder's, or SmolLM2-135M-Instruct)", "",
         aliases=("model-name",), env_aliases=("SPECDEC_MODEL_NAME",)),
    Flag("default-max-tokens", "max_tokens when a request gives none", 256, int),
    Flag("request-timeout", "seconds one generation may take", 600.0, float),
    Flag("grace", "seconds open streams get to finish on SIGTERM", 10.0, float),
    Flag("no-playground", "do not serve the playground page at /playground", False, kind=ON),
    Flag("playground-passes-per-minute", "pass quota: target passes per visitor (client address) per "
         "minute on the playground, 0 = none", 30, int),
    Flag("responses-ttl", "seconds a stored /v1/responses record (the messages of a kept session) is "
         "kept after its last use; as the orchestrator's --record-ttl by default", RECORD_TTL_S, float),
    Flag("max-stored-responses", "stored /v1/responses records held at most (the least recently used "
         "go first; 0 = none: store is ignored)", 10000, int),
    Flag("log-level", "DEBUG, INFO, WARNING...", "INFO"),
))
GUARD = Group("what the gateway accepts", (
    Flag("max-body-bytes", "a request body larger than this is a 413, refused while it is read "
         "(before any parsing)", 4 << 20, int),
    Flag("max-whole-response-bytes", "a request that is not streamed whose worst-case response (n x max_tokens "
         "x (1 + top_logprobs) entries of 64 bytes) is larger is a 400: it would be built whole in memory; "
         "0 = no limit", 64 << 20, int),
    Flag("header-timeout", "seconds a request's line and headers may take to arrive; a connection that "
         "is slower is closed (it would hold a --max-concurrency place); 0 = none", 10.0, float),
    Flag("body-timeout", "seconds a request body may stall (no part of it arriving) before a 408", 30.0, float),
    Flag("max-concurrency", "connections and requests in progress at most; one more is a 503 at once "
         "(uvicorn's limit_concurrency); 0 = no limit", 1024, int),
    Flag("allowed-hosts", "while the orchestrator takes calls without a token: the names a request's "
         "Host (and a browser's Origin) may carry, comma-separated; others are a 403, so no web page "
         "on another origin can drive this gateway; '*' = any", ",".join(LOCAL_HOSTS)),
    Flag("trusted-proxies", "addresses or CIDR blocks (comma-separated) of the proxies whose "
         "X-Forwarded-For names the client for the playground's quota; empty = none (the quota is "
         "per connecting address)", ""),
    Flag("metrics-port", "Prometheus /metrics on its own port (never on the API's), 0 = off", 0, int),
    Flag("metrics-host", "address the metrics endpoint binds (it has no authentication)", "127.0.0.1"),
))
ORCHESTRATOR_TLS = Group("calls to the orchestrator", CLIENT_TLS)


def gateway_settings(description: str) -> Settings:
    return Settings(prog="python -m gateway", description=description, groups=(GATEWAY, GUARD, ORCHESTRATOR_TLS))

"""python -m gateway: serve the OpenAI-compatible HTTP API for one orchestrator.

    python -m gateway --orchestrator 127.0.0.1:50050 --port 8000

Then any OpenAI client works with base_url=http://HOST:8000/v1, e.g.
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": "Hi"}], stream=True)

The playground page is on http://HOST:8000/playground (off with --no-playground); its
pass quota is --playground-passes-per-minute target passes per visitor.

Every flag has a SPECDEC_* environment equivalent (flags win).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _env(name: str, fallback):
    return os.environ.get(f"SPECDEC_{name.upper()}", fallback)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orchestrator", default=_env("orchestrator", "127.0.0.1:50050"),
                   help="orchestrator gRPC address [SPECDEC_ORCHESTRATOR] (default %(default)s)")
    p.add_argument("--host", default=_env("host", "127.0.0.1"),
                   help="address to bind (0.0.0.0 for all interfaces) [SPECDEC_HOST]")
    p.add_argument("--port", type=int, default=_env("gateway_port", 8000),
                   help="HTTP port [SPECDEC_GATEWAY_PORT] (default %(default)s)")
    p.add_argument("--model-name", default=_env("model_name", "specdec"),
                   help="model id listed by /v1/models; requests must name it "
                        "[SPECDEC_MODEL_NAME] (default %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=_env("default_max_tokens", 256),
                   help="max_tokens when a request gives none [SPECDEC_DEFAULT_MAX_TOKENS]")
    p.add_argument("--request-timeout", type=float, default=_env("request_timeout", 600.0),
                   help="seconds one generation may take [SPECDEC_REQUEST_TIMEOUT]")
    p.add_argument("--grace", type=float, default=_env("grace", 10.0),
                   help="seconds open streams get to finish on SIGTERM [SPECDEC_GRACE]")
    p.add_argument("--tls-ca", default=_env("tls_ca", None),
                   help="CA of the orchestrator's certificate; enables TLS to it [SPECDEC_TLS_CA]")
    p.add_argument("--tls-cert", default=_env("client_cert", None),
                   help="client certificate for mutual TLS to the orchestrator [SPECDEC_CLIENT_CERT]")
    p.add_argument("--tls-key", default=_env("client_key", None),
                   help="its private key [SPECDEC_CLIENT_KEY]")
    p.add_argument("--no-playground", action="store_true",
                   default=_env("no_playground", "") not in ("", "0", "false"),
                   help="do not serve the playground page at /playground [SPECDEC_NO_PLAYGROUND=1]")
    p.add_argument("--playground-passes-per-minute", type=int,
                   default=_env("playground_passes_per_minute", 30),
                   help="pass quota: target passes per visitor (client address) per minute on "
                        "the playground, 0 = none [SPECDEC_PLAYGROUND_PASSES_PER_MINUTE] "
                        "(default %(default)s)")
    p.add_argument("--log-level", default=_env("log_level", "INFO"),
                   help="DEBUG, INFO, WARNING... [SPECDEC_LOG_LEVEL]")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = str(args.log_level).upper()
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")
    import uvicorn

    from gateway.app import Settings, create_app
    from gateway.playground import PlaygroundSettings
    from specdec.procs import watch_parent

    watch_parent()  # started by `specdec up`: go when it goes
    passes = int(args.playground_passes_per_minute)
    if passes < 0:
        raise SystemExit("--playground-passes-per-minute: must be >= 0")
    playground = None if args.no_playground else PlaygroundSettings(passes_per_minute=passes)
    app = create_app(Settings(orchestrator=args.orchestrator, model_name=args.model_name,
                              default_max_tokens=int(args.default_max_tokens),
                              timeout_s=float(args.request_timeout), grace_s=float(args.grace),
                              tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              playground=playground))
    log = logging.getLogger("gateway")
    log.info("OpenAI-compatible API on http://%s:%d/v1 -> orchestrator %s",
             args.host, args.port, args.orchestrator)
    if playground is not None:
        log.info("playground on http://%s:%d/playground (%s target passes per visitor per minute)",
                 args.host, args.port, passes or "unlimited")
    uvicorn.run(app, host=args.host, port=int(args.port), log_level=level.lower(),
                access_log=level == "DEBUG", timeout_graceful_shutdown=float(args.grace) + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

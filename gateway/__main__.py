"""python -m gateway: serve the OpenAI-compatible HTTP API for one orchestrator.

    python -m gateway --orchestrator 127.0.0.1:50050 --port 8000

Then any OpenAI client works with base_url=http://HOST:8000/v1, e.g.
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": "Hi"}], stream=True)

The model id is the target's own name (GET /v1/models lists it with its context length), or the
names of --served-model-name; `specdec` is always accepted too.

The playground page is on http://HOST:8000/playground (off with --no-playground); its
pass quota is --playground-passes-per-minute target passes per visitor. Prometheus metrics
are on their own port (--metrics-port), never on the API's.

Every flag has a SPECDEC_* environment equivalent (flags win).
"""
from __future__ import annotations

import argparse
import logging
import sys

from gateway.settings import gateway_settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return gateway_settings(__doc__).parse(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = str(args.log_level).upper()
    logging.basicConfig(level=level,
                        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")
    import uvicorn

    from gateway.app import create_app
    from gateway.guard import header_timeout_protocol, parse_hosts, parse_networks
    from gateway.playground import PlaygroundSettings
    from gateway.served import parse_names
    from gateway.state import Settings
    from specdec.runtime.procs import watch_parent

    watch_parent()  # started by `specdec up`: go when it goes
    passes = int(args.playground_passes_per_minute)
    if passes < 0:
        raise SystemExit("--playground-passes-per-minute: must be >= 0")
    if int(args.max_body_bytes) < 1:
        raise SystemExit("--max-body-bytes: must be >= 1")
    if float(args.body_timeout) <= 0:
        raise SystemExit("--body-timeout: must be > 0")
    if float(args.header_timeout) < 0:
        raise SystemExit("--header-timeout: must be >= 0 (0 = none)")
    if int(args.max_concurrency) < 0:
        raise SystemExit("--max-concurrency: must be >= 0 (0 = no limit)")
    playground = None if args.no_playground else PlaygroundSettings(
        passes_per_minute=passes, trusted_proxies=parse_networks(args.trusted_proxies))
    app = create_app(Settings(orchestrator=args.orchestrator, spread=bool(args.spread),
                              multiplex=bool(args.multiplex),
                              served_model_names=parse_names(args.served_model_name),
                              default_max_tokens=int(args.default_max_tokens),
                              timeout_s=float(args.request_timeout), grace_s=float(args.grace),
                              tls_ca=args.tls_ca, tls_cert=args.client_cert, tls_key=args.client_key,
                              playground=playground, max_body_bytes=int(args.max_body_bytes),
                              body_timeout_s=float(args.body_timeout),
                              max_whole_response_bytes=int(args.max_whole_response_bytes),
                              allowed_hosts=parse_hosts(args.allowed_hosts),
                              responses_ttl_s=float(args.responses_ttl),
                              max_stored_responses=int(args.max_stored_responses)))
    log = logging.getLogger("gateway")
    if int(args.metrics_port):
        from specdec.runtime.server import serve_metrics

        serve_metrics(int(args.metrics_port), args.metrics_host)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, int(args.metrics_port))
    log.info("OpenAI-compatible API on http://%s:%d/v1 -> orchestrator %s",
             args.host, args.port, args.orchestrator)
    if playground is not None:
        log.info("playground on http://%s:%d/playground (%s target passes per visitor per minute)",
                 args.host, args.port, passes or "unlimited")
    # proxy_headers off: uvicorn would otherwise take X-Forwarded-For from 127.0.0.1 as the client
    # (a local caller could claim any address); gateway.guard.client_address decides instead.
    uvicorn.run(app, host=args.host, port=int(args.port), log_level=level.lower(),
                access_log=level == "DEBUG", timeout_graceful_shutdown=float(args.grace) + 1,
                proxy_headers=False, limit_concurrency=int(args.max_concurrency) or None,
                http=header_timeout_protocol(float(args.header_timeout)) if float(args.header_timeout) else "h11")
    return 0


if __name__ == "__main__":
    sys.exit(main())

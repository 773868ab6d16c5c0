"""The grpc.aio server bootstrap every specdec server shares.

    opts = options_from_args(args)            # after add_server_args(parser, default_port=...)
    exit_code = run_server(
        [partial(model_pb2_grpc.add_TargetServiceServicer_to_server, servicer)],
        ["specdec.v1.TargetService"],
        opts,
        on_serving=hook,                      # optional, e.g. Redis registration
    )

It adds the error-mapping interceptor, grpc.health.v1 (SERVING once `serve`
runs, i.e. after the caller loaded its model; NOT_SERVING while draining),
server reflection, a Prometheus HTTP endpoint (--metrics-port), and a graceful
SIGTERM/SIGINT: health NOT_SERVING, the on_serving cleanup (deregistration)
at once, then -- with a `drain` (specdec.drain, the model services) --
new calls refused as "draining" while in-flight ones finish and live sessions
move away, all within the drain deadline (--grace seconds); exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter

from specdec import tracing
from specdec.errors import ErrorInterceptor
from specdec.security import ServerSecurity, add_security_args, security_from_args
from specdec.drain import Drain
from specdec.procs import watch_parent

log = logging.getLogger(__name__)

REQUESTS = Counter(
    "specdec_requests_total", "gRPC calls finished, by method and status code", ["method", "code"]
)

Adder = Callable[[grpc.aio.Server], None]
# Awaited once the server is SERVING, with the address it listens on. It may
# return an async cleanup, awaited first thing on shutdown (e.g. deregister).
OnServing = Callable[[str], Awaitable[Callable[[], Awaitable[None]] | None]]


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # 0 = no metrics endpoint
    grace_s: float = 10.0
    redis_url: str = ""  # empty = do not register (see on_serving)
    redis_prefix: str = "specdec:"
    advertise_address: str = ""  # what others dial; default host:port
    log_level: str = "INFO"
    trace_file: str = ""  # JSON-lines spans (specdec.tracing); "" = off unless OTEL_TRACES_EXPORTER
    metrics_host: str = "127.0.0.1"  # the metrics endpoint's bind address
    security: ServerSecurity = ServerSecurity()  # TLS, tokens, --insecure
    # gRPC message caps; the model services size them from the model (serve.py).
    max_receive_bytes: int = 256 << 20
    max_send_bytes: int = 256 << 20

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def public_address(self) -> str:
        """The address to announce: --advertise-address, else host:port (hostname for 0.0.0.0)."""
        if self.advertise_address:
            return self.advertise_address
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{self.port}"


def env_default(name: str, fallback: str | int | float | None) -> str | int | float | None:
    """The SPECDEC_<NAME> environment variable, else `fallback` (flags override both)."""
    return os.environ.get(f"SPECDEC_{name.upper()}", fallback)


def env_flag(name: str, default: bool) -> bool:
    """A switch's SPECDEC_<NAME>: a default-on switch is off only for 0/false/no/off, a
    default-off one on only for 1/true/yes/on (flags override both)."""
    value = os.environ.get(f"SPECDEC_{name.upper()}")
    if value is None:
        return default
    value = value.strip().lower()
    return value not in ("0", "false", "no", "off") if default else value in ("1", "true", "yes", "on")


def add_server_args(parser: argparse.ArgumentParser, *, default_port: int,
                    auth: str = "service") -> None:
    """The flags every server takes; each has a SPECDEC_* environment equivalent.

    `auth`: "service" (model services: --service-token) or "tenants" (the
    orchestrator: --auth-tokens); see specdec.security.
    """
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="address to bind (0.0.0.0 for all interfaces) [SPECDEC_HOST]")
    g.add_argument("--port", type=int, default=env_default("port", default_port),
                   help="gRPC port [SPECDEC_PORT] (default %(default)s)")
    g.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                   help="Prometheus HTTP port, 0 = off [SPECDEC_METRICS_PORT]")
    g.add_argument("--metrics-host", default=env_default("metrics_host", "127.0.0.1"),
                   help="address the metrics endpoint binds (it has no authentication) "
                        "[SPECDEC_METRICS_HOST] (default %(default)s)")
    g.add_argument("--grace", type=float, default=env_default("grace", 10.0),
                   help="drain deadline: seconds after SIGTERM for in-flight calls to finish and "
                        "live sessions to move to other replicas before exit [SPECDEC_GRACE]")
    g.add_argument("--redis-url", default=env_default("redis_url", ""),
                   help="register this server in Redis with a heartbeat, e.g. "
                        "redis://127.0.0.1:6379/0; empty = off [SPECDEC_REDIS_URL]")
    g.add_argument("--redis-prefix", default=env_default("redis_prefix", "specdec:"),
                   help="key prefix in Redis [SPECDEC_REDIS_PREFIX]")
    g.add_argument("--advertise-address", default=env_default("advertise_address", ""),
                   help="host:port other processes dial, if not --host:--port "
                        "[SPECDEC_ADVERTISE_ADDRESS]")
    g.add_argument("--log-level", default=env_default("log_level", "INFO"),
                   help="DEBUG, INFO, WARNING... [SPECDEC_LOG_LEVEL]")
    tracing.add_args(g)
    add_security_args(parser, auth=auth)


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        host=args.host,
        port=int(args.port),
        metrics_port=int(args.metrics_port),
        grace_s=float(args.grace),
        redis_url=args.redis_url or "",
        redis_prefix=args.redis_prefix,
        advertise_address=args.advertise_address or "",
        log_level=str(args.log_level).upper(),
        trace_file=args.trace_file or "",
        metrics_host=args.metrics_host,
        security=security_from_args(args),
    )


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
    )


def _observe(method: str, code: str) -> None:
    REQUESTS.labels(method=method, code=code).inc()


async def serve(
    adders: Sequence[Adder],
    service_names: Sequence[str],
    options: ServerOptions,
    *,
    on_serving: OnServing | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    drain: Drain | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or the death of the launcher that started it), then drain."""
    watch_parent()  # started by specdec.procs: SIGTERM ourselves when the launcher is gone
    if drain is not None:
        interceptors = [*interceptors, drain.interceptor()]
    options.security.check_bind(options.host)
    # service.name: specdec-target, specdec-draft, specdec-orchestrator
    if tracing.configure(options.trace_file, "specdec-" + service_names[0].rsplit(".", 1)[-1]
                         .removesuffix("Service").lower()):
        from specdec.tracing.grpc_server import TracingInterceptor  # the OpenTelemetry API: only when on

        interceptors = [*interceptors, TracingInterceptor(options.public_address)]
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(_observe, guard=options.security.guard()), *interceptors],
        options=[("grpc.max_send_message_length", options.max_send_bytes),
                 ("grpc.max_receive_message_length", options.max_receive_bytes)],
    )
    for add in adders:
        add(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    credentials = options.security.credentials()
    bound = (server.add_secure_port(options.address, credentials) if credentials
             else server.add_insecure_port(options.address))
    if bound == 0:
        raise OSError(f"cannot bind {options.address}")
    if options.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(options.metrics_port, addr=options.metrics_host)
        log.info("metrics on http://%s:%d/metrics", options.metrics_host, options.metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await server.start()
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s", ", ".join(service_names), options.address)
    cleanup = await on_serving(options.address) if on_serving else None

    await stop.wait()
    log.info("shutting down: draining (deadline %.1f s)", options.grace_s)
    deadline = time.monotonic() + options.grace_s
    await health.enter_graceful_shutdown()  # every service NOT_SERVING
    if drain is not None:
        drain.begin()  # new calls: UNAVAILABLE "draining: ..."
    if cleanup is not None:
        # Bounded by the drain deadline: a clean-up that hangs (a wedged Redis connection, say)
        # must not keep the process alive past it.
        try:
            await asyncio.wait_for(cleanup(), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            log.warning("on_serving cleanup still running at the drain deadline: going on without it")
        except Exception:  # noqa: BLE001 - shutdown goes on regardless
            log.exception("on_serving cleanup failed")
    if drain is not None:
        settled = await drain.wait(deadline - time.monotonic())
        log.info("drain %s: %d call(s) refused, %d still running",
                 "done" if settled else "deadline reached", drain.refused, drain.in_flight)
    await server.stop(max(0.0, deadline - time.monotonic()))
    tracing.shutdown()  # flush the spans still queued
    log.info("stopped")


def run_server(
    adders: Sequence[Adder],
    service_names: Sequence[str],
    options: ServerOptions,
    *,
    on_serving: OnServing | None = None,
    drain: Drain | None = None,
) -> int:
    """Blocking wrapper around `serve`; returns the process exit code (0 after a clean drain)."""
    asyncio.run(serve(adders, service_names, options, on_serving=on_serving, drain=drain))
    return 0

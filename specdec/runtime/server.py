"""The grpc.aio server bootstrap every specdec server shares.

    opts = options_from_args(args)            # flags: specdec.runtime.settings.server_group(port)
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
at once, then -- with a `drain` (specdec.runtime.drain, the model services) --
new calls refused as "draining" while in-flight ones finish and live sessions
move away, all within the drain deadline (--grace seconds); exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
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

from specdec.runtime import heap, tracing
from specdec.runtime import loop as event_loop
from specdec.runtime.errors import ErrorInterceptor
from specdec.runtime.security import ServerSecurity, security_from_args
from specdec.runtime.drain import Drain
from specdec.runtime.procs import watch_parent

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
    trace_file: str = ""  # JSON-lines spans (specdec.runtime.tracing); "" = off unless OTEL_TRACES_EXPORTER
    metrics_host: str = "127.0.0.1"  # the metrics endpoint's bind address
    health_port: int = 0  # plaintext grpc.health.v1 alone on 127.0.0.1 (in-pod probes); 0 = off
    security: ServerSecurity = ServerSecurity()  # TLS, tokens, --insecure
    # gRPC message caps; the model services size them from the model (serve.py).
    max_receive_bytes: int = 256 << 20
    max_send_bytes: int = 256 << 20
    keepalive_s: float = 60.0  # ping idle connections; 0 = off
    keepalive_timeout_s: float = 20.0  # an unanswered ping drops the connection after this
    max_connection_age_s: float = 0.0  # GOAWAY a connection this old; 0 = off
    max_connection_age_grace_s: float = 300.0  # its calls in flight may run this much longer
    event_loop: str = "auto"  # specdec.runtime.loop: uvloop where installed

    def grpc_options(self) -> list[tuple[str, int]]:
        """The grpc.aio server's channel arguments: message caps, keepalive, connection age."""
        out = [("grpc.max_send_message_length", self.max_send_bytes),
               ("grpc.max_receive_message_length", self.max_receive_bytes)]
        if self.keepalive_s > 0:
            out += [("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
                    ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
                    ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0)]
        if self.max_connection_age_s > 0:
            out += [("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(self.max_connection_age_grace_s * 1000))]
        return out

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
        health_port=int(getattr(args, "health_port", 0) or 0),
        security=security_from_args(args),
        keepalive_s=float(getattr(args, "keepalive_s", 60.0)),
        keepalive_timeout_s=float(getattr(args, "keepalive_timeout_s", 20.0)),
        max_connection_age_s=float(getattr(args, "max_connection_age_s", 0.0)),
        max_connection_age_grace_s=float(getattr(args, "max_connection_age_grace_s", 300.0)),
        event_loop=getattr(args, "event_loop", "auto") or "auto",
    )


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
    )


def observe_call(method: str, code: str) -> None:
    """One finished call (a GenerateMany stream counts each of its generations) in REQUESTS."""
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
    watch_parent()  # started by specdec.runtime.procs: SIGTERM ourselves when the launcher is gone
    if drain is not None:
        interceptors = [*interceptors, drain.interceptor()]
    options.security.check_bind(options.host)
    # service.name: specdec-target, specdec-draft, specdec-orchestrator
    if tracing.configure(options.trace_file, "specdec-" + service_names[0].rsplit(".", 1)[-1]
                         .removesuffix("Service").lower()):
        from specdec.runtime.tracing.grpc_server import TracingInterceptor  # the OpenTelemetry API: only when on

        interceptors = [*interceptors, TracingInterceptor(options.public_address)]
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(observe_call, guard=options.security.guard()), *interceptors],
        options=options.grpc_options(),
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
    health_only = _health_server(health, options.health_port) if options.health_port else None
    if options.metrics_port:
        serve_metrics(options.metrics_port, options.metrics_host)
        log.info("metrics on http://%s:%d/metrics", options.metrics_host, options.metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await server.start()
    if health_only is not None:
        await health_only.start()
    heap.settle()  # the start-up heap (model, libraries) is never walked by the collector again
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
    if health_only is not None:
        await health_only.stop(0)
    tracing.shutdown()  # flush the spans still queued
    log.info("stopped")


METRICS_TIMEOUT_S = 10.0  # a metrics connection silent this long is closed


def serve_metrics(port: int, host: str = "127.0.0.1", timeout_s: float = METRICS_TIMEOUT_S):
    """Prometheus /metrics on its own port, served from a daemon thread. Unlike
    prometheus_client.start_http_server, a connection that sends nothing for `timeout_s` is
    closed, so idle or slow clients cannot pile up threads. Returns the HTTP server."""
    import threading
    from http.server import ThreadingHTTPServer

    from prometheus_client import REGISTRY
    from prometheus_client.exposition import MetricsHandler

    class Handler(MetricsHandler.factory(REGISTRY)):
        timeout = timeout_s  # socket timeout per connection (socketserver.StreamRequestHandler)

        def log_message(self, format, *args):  # noqa: A002 - no line per scrape
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host.strip("[]"), port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def _health_server(health: HealthServicer, port: int) -> grpc.aio.Server:
    """grpc.health.v1 alone, plaintext, on loopback: probes inside the pod need no client
    certificate, and nothing else is served there (no other method, no other interface)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind the health port 127.0.0.1:{port}")
    return server


def run_server(
    adders: Sequence[Adder],
    service_names: Sequence[str],
    options: ServerOptions,
    *,
    on_serving: OnServing | None = None,
    drain: Drain | None = None,
) -> int:
    """Blocking wrapper around `serve`; returns the process exit code (0 after a clean drain)."""
    event_loop.run(serve(adders, service_names, options, on_serving=on_serving, drain=drain), options.event_loop)
    return 0

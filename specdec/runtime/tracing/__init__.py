"""Round-level traces: OpenTelemetry spans per request, round, step and model call. Off by default.

Turned on per process by `--trace-file PATH` (SPECDEC_TRACE_FILE: JSON lines, one
span per line, specdec.runtime.tracing.jsonl) or by the standard variables
(`OTEL_TRACES_EXPORTER=otlp` with `OTEL_EXPORTER_OTLP_ENDPOINT`, ...; `console`
works too). Off, nothing here imports the OpenTelemetry SDK or an exporter:
`request()` returns a no-op recorder and the other hooks return at once.

What a Generate produces (orchestrator; * = explicit start/end taken from the
same perf_counter readings as Stats, so durations equal the Stats figures):

    Generate*                        = Stats.total_ms
      round*  (one per round)        = Stats.rounds[i].total_ms, attributes k, drafted, ...
        redis wait*                  Σ over the round = rounds[i].redis_ms
        propose*   -> {draft service} Propose*   = rounds[i].draft_ms
                   -> rpc DraftService/Propose* (client; children encode*, decode*)
        score*     -> {target service} Score*    = rounds[i].target_ms
                   -> rpc TargetService/Score*  (client; children encode*, decode*)
        verify*
        commit*    (verify's end to the round's end: cut, bookkeeping, Redis, stream)
          redis wait*, redis write* (the record's write; with specdec.round_state
                     = true it is the round's own state: = rounds[i].redis_write_ms)

Per round: serialize_ms = Σ encode + decode; network_ms = Σ (rpc − service span
− encode − decode) over the round's answered calls (a failed call counts in
orchestrator_ms, as in Stats). The service spans (Score, Propose, with queue
and forward children) come from the model services' own processes: the step's
context travels in gRPC metadata (W3C traceparent through the OpenTelemetry
propagator), so they nest under the orchestrator's propose/score spans.
specdec.runtime.tracing.timeline recomputes these figures from a trace;
specdec.runtime.tracing.plot draws them.
"""
from __future__ import annotations

import atexit
import contextvars
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ENABLED = False  # set once by configure(); read by every hook
_tracer: Any = None
_provider: Any = None
_offset_ns = 0  # epoch ns - perf_counter ns, fixed at configure()

# The OpenTelemetry Context that RPCs and intervals in this task nest under (a
# step, a round, a request, or a caller's remote context), and its metadata.
_parent: contextvars.ContextVar[Any] = contextvars.ContextVar("specdec_trace_parent", default=None)
_metadata: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("specdec_trace_md", default=None)

ROLE_SERVICE = {"target": "TargetService", "draft": "DraftService"}


def wanted(trace_file: str | None) -> bool:
    """Whether tracing is asked for: a trace file, or OTEL_TRACES_EXPORTER naming an exporter."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(trace_file) or bool(_otel_exporters())


def _otel_exporters() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "")
    return [n.strip().lower() for n in names.split(",") if n.strip() and n.strip().lower() != "none"]


def configure(trace_file: str | None, service: str) -> bool:
    """Set up the tracer provider and exporters if asked for; True when tracing is on.

    `service` is the resource's service.name (OTEL_SERVICE_NAME wins).
    """
    global ENABLED, _tracer, _provider, _offset_ns
    if ENABLED or not wanted(trace_file):
        return ENABLED
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attributes))
    if trace_file:
        from specdec.runtime.tracing.jsonl import JsonLinesExporter

        provider.add_span_processor(BatchSpanProcessor(JsonLinesExporter(trace_file),
                                                       schedule_delay_millis=500))
    for name in _otel_exporters():
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    _provider, _tracer = provider, provider.get_tracer("specdec")
    _offset_ns = time.time_ns() - time.perf_counter_ns()
    ENABLED = True
    atexit.register(shutdown)
    log.info("tracing on (%s)", ", ".join(filter(None, [trace_file, *_otel_exporters()])))
    return True


def _exporter(name: str):
    """An exporter named by OTEL_TRACES_EXPORTER; OTLP over gRPC unless the protocol says http."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: {name!r} is not supported here (otlp, console, none)")
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    if protocol.startswith("http"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise SystemExit(f"OTLP protocol {protocol} needs opentelemetry-exporter-otlp-proto-http "
                             "(pip install it, or use the default grpc protocol)") from None
        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, TLS from OTEL_EXPORTER_OTLP_*


def shutdown() -> None:
    """Flush and close the exporters (on a clean stop; also registered atexit)."""
    global ENABLED
    if _provider is not None and ENABLED:
        ENABLED = False
        _provider.shutdown()


def epoch_ns(perf_s: float) -> int:
    """A time.perf_counter() reading as epoch nanoseconds (the process's one offset)."""
    return _offset_ns + round(perf_s * 1e9)


# ------------------------------------------------------------------ spans


def _start(name: str, parent: Any, start: float, kind: str = "INTERNAL", attributes: dict | None = None):
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=parent, kind=getattr(SpanKind, kind),
                              start_time=epoch_ns(start), attributes=attributes)


def _context_of(span) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def _set_parent(ctx: Any) -> None:
    """Make `ctx` the parent of what this task traces next, with its traceparent metadata."""
    _parent.set(ctx)
    if ctx is None:
        _metadata.set(None)
        return
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    _metadata.set(tuple(carrier.items()) or None)


def _error(span, exc: BaseException | str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, str(exc)[:300]))
    if isinstance(exc, BaseException):
        span.set_attribute("error.type", type(exc).__name__)


def interval(name: str, start: float, end: float, **attributes: Any) -> None:
    """A span [start, end] (perf_counter seconds) under this task's current parent.

    Keyword attributes are recorded as specdec.<name>.
    """
    if not ENABLED:
        return
    parent = _parent.get()
    if parent is None:
        return
    attrs = {f"specdec.{k}": v for k, v in attributes.items()} or None
    _start(name, parent, start, attributes=attrs).end(end_time=epoch_ns(end))


def rpc_metadata(base: Any = None) -> Any:
    """`base` metadata plus the traceparent of what this task traces now (just `base` when off)."""
    if not ENABLED:
        return base
    extra = _metadata.get()
    if not extra:
        return base
    return (*base, *extra) if base else extra


def rpc_span(role: str, method: str, address: str, start: float, encoded: float | None,
             received: float | None, end: float, call: Any = None, error: BaseException | None = None) -> None:
    """The client side of one model-service call, after the fact, with the times ModelClient measured.

    Children: encode [start, encoded] and decode [received, end]; together Call.serialize_ms.
    """
    if not ENABLED or _parent.get() is None:
        return
    service = f"specdec.v1.{ROLE_SERVICE.get(role, role)}"
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                  "server.address": address, "specdec.role": role}
    if call is not None:
        attributes |= {"specdec.bytes_sent": call.bytes_sent, "specdec.bytes_received": call.bytes_received,
                       "specdec.rpc_ms": call.rpc_ms, "specdec.server_ms": call.server_ms,
                       "specdec.serialize_ms": call.serialize_ms, "specdec.network_ms": call.network_ms}
    span = _start(f"{service}/{method}", _parent.get(), start, "CLIENT", attributes)
    ctx = _context_of(span)
    if encoded is not None:
        _start("encode", ctx, start).end(end_time=epoch_ns(encoded))
    if received is not None:
        _start("decode", ctx, received).end(end_time=epoch_ns(end))
    if error is not None:
        _error(span, error)
        span.set_attribute("specdec.cache_miss", type(error).__name__ == "CacheMiss")
    span.end(end_time=epoch_ns(end))


# ------------------------------------------------------------ the request


class _NoTrace:
    """What the loop gets when tracing is off: every hook does nothing."""

    __slots__ = ()

    def step(self, name: str) -> _NoTrace:
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def round_closed(self, rnd: Any) -> None:
        pass

    def finish(self) -> None:
        pass

    def abort(self, exc: BaseException) -> None:
        pass


NO_TRACE = _NoTrace()


def request(tally: Any) -> RequestTrace | _NoTrace:
    """The recorder of one Generate (a no-op when tracing is off)."""
    return RequestTrace(tally) if ENABLED else NO_TRACE


class RequestTrace:
    """Spans of one Generate, timed with the Tally's own clock readings.

    Rounds are contiguous like Stats.rounds: round 1 opens with the request (it
    carries the session load and routing), each closes when the Tally closes
    it, the next opens at that instant when its first step starts.
    """

    def __init__(self, tally: Any) -> None:
        self.tally = tally
        self.span = _start("Generate", _parent.get(), tally.started, "SERVER")
        self.ctx = _context_of(self.span)
        self.round = self.round_ctx = self.commit = None
        self.n = 0
        self._open_round(tally.started)

    def _open_round(self, start: float) -> None:
        self.n += 1
        self.round = _start("round", self.ctx, start, attributes={"specdec.round": self.n})
        self.round_ctx = _context_of(self.round)
        _set_parent(self.round_ctx)

    def step(self, name: str) -> _Step:
        """A `with` block timing one step of the round (propose, score, verify)."""
        if self.round is None:
            self._open_round(self.tally.round_started)
        return _Step(self, name)

    def round_closed(self, rnd: Any) -> None:
        """After Tally.close_round(rnd): end commit and the round at the Tally's round end."""
        end = epoch_ns(self.tally.round_started)
        if self.commit is not None:
            self.commit.end(end_time=end)
            self.commit = None
        self.round.set_attributes({f"specdec.{f}": v for f, v in rnd.as_dict().items()})
        self.round.end(end_time=end)
        self.round = self.round_ctx = None
        _set_parent(self.ctx)

    def finish(self) -> None:
        """After Tally.finish(): the request span ends at started + total_ms."""
        t = self.tally
        self.span.set_attributes({
            "specdec.session_id": t.session_id, "specdec.proposer": t.proposer,
            "specdec.finish_reason": t.finish_reason, "specdec.rounds": len(t.rounds),
            "specdec.prompt_tokens": t.prompt_tokens, "specdec.new_tokens": t.new_tokens,
            "specdec.target_passes": t.target_passes, "specdec.drafted": t.drafted_tokens,
            "specdec.accepted": t.accepted_tokens, "specdec.cache_misses": t.cache_misses,
            "specdec.target_replica": t.target_replica, "specdec.draft_replica": t.draft_replica,
            "specdec.fallback_reason": t.fallback_reason, "specdec.total_ms": t.total_ms,
        })
        self.span.end(end_time=epoch_ns(t.started + t.total_ms / 1e3))
        _set_parent(None)

    def abort(self, exc: BaseException) -> None:
        """The request failed or was cancelled: end what is open, marked as an error."""
        end = epoch_ns(time.perf_counter())
        for span in (self.commit, self.round, self.span):
            if span is not None:
                _error(span, exc if str(exc) else type(exc).__name__)
                span.end(end_time=end)
        self.commit = self.round = None
        _set_parent(None)


class _Step:
    __slots__ = ("trace", "name", "start", "span")

    def __init__(self, trace: RequestTrace, name: str) -> None:
        self.trace, self.name = trace, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        self.span = _start(self.name, self.trace.round_ctx, self.start)
        _set_parent(_context_of(self.span))

    def __exit__(self, exc_type, exc, tb) -> None:
        end = time.perf_counter()
        tr = self.trace
        if exc is not None:
            _error(self.span, exc)
        self.span.end(end_time=epoch_ns(end))
        _set_parent(tr.round_ctx)
        if self.name == "verify" and exc is None:  # commit: from here to the round's end
            tr.commit = _start("commit", tr.round_ctx, end)
            _set_parent(_context_of(tr.commit))

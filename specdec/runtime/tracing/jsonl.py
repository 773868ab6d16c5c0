"""A span exporter writing JSON lines: one finished span per line, appended to a file.

Each line: {"trace_id", "span_id", "parent_id" (null for a root), "name", "kind"
(SERVER, CLIENT, INTERNAL), "service" (the resource's service.name),
"start_ns", "end_ns" (epoch nanoseconds), "status" (UNSET, OK, ERROR),
"status_message", "attributes"}. Ids are lower-case hex as in a W3C
traceparent. Several processes may append to one file (each line is one write).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan) -> dict:
    ctx = span.context
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description or "",
        "attributes": dict(span.attributes or {}),
    }


class JsonLinesExporter(SpanExporter):
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), separators=(",", ":"), default=str) + "\n"
                       for s in spans).encode()
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

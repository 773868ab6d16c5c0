"""specdec.runtime.tracing without processes: off by default (nothing imported, nothing written), and the
loop's spans on the Tally's clock (the fake services of test_loop; the services' own spans and
the trace across processes are in tests/integration/test_tracing.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.runtime import tracing
from specdec.runtime.tracing import timeline as tl

ROOT = Path(__file__).resolve().parents[2]

OFF_SCRIPT = """
import json, sys
from orchestrator.__main__ import parse_args
from specdec.runtime import tracing
from specdec.runtime.server import options_from_args
from tests.unit.test_loop import PROMPTS, Stack, make_models

options = options_from_args(parse_args([]))
on = tracing.configure(options.trace_file, "specdec-orchestrator")
ids, _, tally = Stack(*make_models(0)).run(PROMPTS[0], k=4)
print(json.dumps({
    "on": on, "enabled": tracing.ENABLED, "noop": tracing.request(tally) is tracing.NO_TRACE,
    "tokens": len(ids), "rounds": len(tally.rounds),
    # (redis imports opentelemetry.sdk.metrics by itself when the SDK is installed)
    "otel": sorted(m for m in sys.modules if m.startswith(
        ("opentelemetry.sdk.trace", "opentelemetry.exporter", "specdec.runtime.tracing."))),
}))
"""


def test_tracing_is_off_by_default_imports_no_exporter_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "SPECDEC_TRACE_FILE"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", OFF_SCRIPT], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens"] and result["rounds"]
    assert not result["on"] and not result["enabled"] and result["noop"]
    assert result["otel"] == []
    assert list(tmp_path.iterdir()) == []


def test_otel_variables_decide(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.wanted("")
    assert tracing.wanted("/tmp/t.jsonl")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.wanted("")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    assert tracing.wanted("")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.wanted("/tmp/t.jsonl")


@pytest.fixture
def traced_loop(tmp_path, monkeypatch):
    """One generation of the fake-service loop with a trace file; tracing off again afterwards."""
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    from tests.unit.test_loop import PROMPTS, Stack, make_models

    path = tmp_path / "orch.jsonl"
    assert tracing.configure(str(path), "specdec-orchestrator")
    try:
        ids, _, tally = Stack(*make_models(1)).run(PROMPTS[0], k=4)
    finally:
        tracing.shutdown()
    assert not tracing.ENABLED
    return tl.load([path]), tally


def test_loop_spans_equal_the_tally(traced_loop):
    spans, tally = traced_loop
    t = tl.timeline(spans)
    assert abs(tl.ms(t.request) - tally.total_ms) < 1e-3
    assert len(t.rounds) == len(tally.rounds) > 1
    names = {s["name"] for s in spans}
    assert {"Generate", "round", "propose", "score", "verify", "commit", "redis wait", "redis write"} <= names
    for r, want in zip(t.rounds, tally.rounds):
        assert abs(r.total_ms - want.total_ms) < 1e-3
        assert abs(r.redis_ms - want.redis_ms) < 1e-3
        assert abs(r.redis_write_ms - want.redis_write_ms) < 1e-3
        a = r.attributes
        assert (a["specdec.k"], a["specdec.drafted"], a["specdec.accepted"], a["specdec.committed"]) == (
            want.k, want.drafted, want.accepted, want.committed)
    # Rounds are contiguous and cover the request, as in Stats.
    assert t.rounds[0].span["start_ns"] == t.request["start_ns"]
    for a, b in zip(t.rounds, t.rounds[1:]):
        assert a.span["end_ns"] == b.span["start_ns"]
    # Every span belongs to the one trace; steps sit under their round.
    assert {s["trace_id"] for s in spans} == {t.trace_id}
    by_id = {s["span_id"]: s for s in spans}
    for s in spans:
        if s["name"] in ("propose", "score", "verify", "commit"):
            assert by_id[s["parent_id"]]["name"] == "round"


OTLP_SCRIPT = """
from specdec.runtime import tracing
from tests.unit.test_loop import PROMPTS, Stack, make_models

assert tracing.configure("", "specdec-orchestrator")
Stack(*make_models(2)).run(PROMPTS[1], k=3)
tracing.shutdown()
"""


def test_otlp_export_through_the_standard_variables(tmp_path):
    """OTEL_TRACES_EXPORTER=otlp sends the loop's spans to a collector over OTLP/gRPC."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802
            for resource_spans in request.resource_spans:
                for scope in resource_spans.scope_spans:
                    received.extend(span.name for span in scope.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "SPECDEC_TRACE_FILE"}
        env |= {"PYTHONPATH": str(ROOT), "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        subprocess.run([sys.executable, "-c", OTLP_SCRIPT], cwd=tmp_path, env=env, check=True,
                       capture_output=True, text=True, timeout=120)
    finally:
        server.stop(None)
    assert {"Generate", "round", "propose", "score", "verify", "commit"} <= set(received)
    assert list(tmp_path.iterdir()) == []  # no file without --trace-file

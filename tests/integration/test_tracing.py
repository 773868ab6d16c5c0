"""Round-level traces across real processes: tiny target + tiny draft + orchestrator, each with
--trace-file, one greedy Generate with the draft proposer sent with the caller's traceparent.

Which span equals which Stats.rounds[i] field (all milliseconds; specdec.runtime.tracing.timeline):
  round span duration                                   = total_ms
  the draft service's Propose span (its own process)    = draft_ms
  the target service's Score span                       = target_ms
  Σ encode + decode under the round's rpc (CLIENT) spans = serialize_ms
  Σ rpc spans − draft_ms − target_ms − serialize_ms     = network_ms
  Σ "redis wait" spans in the round                     = redis_ms
  the round's own "redis write" span                    = redis_write_ms
  the rest of the round                                 = orchestrator_ms
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.runtime.tracing import timeline as tl
from tests.integration.stack import ENV, Stack

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE_MS = 0.1
FIELDS = ("total_ms", "draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms",
          "redis_ms", "redis_write_ms")


@pytest.fixture(scope="module")
def traced(tiny_pair, tmp_path_factory):
    from client import Client

    target_dir, draft_dir = tiny_pair
    traces = tmp_path_factory.mktemp("traces")
    stack = Stack(logs=tmp_path_factory.mktemp("trace-logs"))
    trace_id = secrets.token_hex(16)
    try:
        for role, folder in (("target", target_dir), ("draft", draft_dir)):
            stack.start_service(role, role, folder, extra=("--trace-file", str(traces / f"{role}.jsonl")))
        stack.start_orchestrator("orch", target_dir, extra=("--trace-file", str(traces / "orch.jsonl")))
        with Client(stack.addresses["orch"], timeout=120) as client:
            stream = client.generate("The cat sat on the mat. The dog", max_new_tokens=24, temperature=0.0,
                                     proposer="draft", k=3,
                                     metadata=[("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01")])
            text = "".join(chunk.text for chunk in stream)
            stats = stream.stats
    finally:
        stack.stop()  # SIGTERM: each process flushes its spans before it exits
    spans = tl.load([traces])
    return SimpleNamespace(dir=traces, trace_id=trace_id, stats=stats, text=text, spans=spans,
                           files={p.stem: tl.load([p]) for p in traces.glob("*.jsonl")})


def test_one_trace_across_the_three_processes(traced):
    assert traced.stats.target_passes > 1 and traced.stats.drafted_tokens > 0
    assert set(traced.files) == {"orch", "target", "draft"}
    for name, spans in traced.files.items():
        assert spans, name
        assert {s["trace_id"] for s in spans} == {traced.trace_id}, name
    services = {s["service"] for s in traced.spans}
    assert services == {"specdec-orchestrator", "specdec-target", "specdec-draft"}


def test_service_spans_nest_under_the_rounds_steps(traced):
    by_id = {s["span_id"]: s for s in traced.spans}
    served = [s for s in traced.spans if s["kind"] == "SERVER" and s["name"].endswith(("/Score", "/Propose"))]
    assert {s["name"] for s in served} == {"specdec.v1.TargetService/Score", "specdec.v1.DraftService/Propose"}
    for s in served:
        step = by_id[s["parent_id"]]
        assert step["service"] == "specdec-orchestrator"
        assert step["name"] == ("score" if s["name"].endswith("Score") else "propose")
        assert by_id[step["parent_id"]]["name"] == "round"
        children = {c["name"] for c in traced.spans if c["parent_id"] == s["span_id"]}
        assert children == {"queue", "forward"}
    generate = [s for s in traced.spans if s["name"] == "Generate"]
    assert len(generate) == 1 and generate[0]["parent_id"]  # under the caller's traceparent
    a = generate[0]["attributes"]
    assert a["specdec.session_id"] == traced.stats.session_id
    assert a["specdec.target_replica"] == traced.stats.target_replica


def test_every_round_matches_stats_within_a_tenth_of_a_millisecond(traced):
    t = tl.timeline(traced.spans, traced.trace_id)
    rounds = traced.stats.rounds
    assert len(t.rounds) == len(rounds) == traced.stats.target_passes
    assert abs(tl.ms(t.request) - traced.stats.total_ms) < TOLERANCE_MS
    worst = 0.0
    for got, want in zip(t.rounds, rounds):
        a = got.attributes
        assert (a["specdec.k"], a["specdec.drafted"], a["specdec.accepted"], a["specdec.committed"]) == (
            want.k, want.drafted, want.accepted, want.committed)
        assert (a["specdec.bytes_sent"], a["specdec.bytes_received"]) == (want.bytes_sent, want.bytes_received)
        for field in FIELDS:
            diff = abs(getattr(got, field) - getattr(want, field))
            worst = max(worst, diff)
            assert diff < TOLERANCE_MS, (got.index, field, getattr(got, field), getattr(want, field))
        assert got.target_ms > 0 and got.network_ms > 0 and (got.draft_ms > 0) == (want.k > 0)
    print(f"max |trace - Stats.rounds| = {worst:.6f} ms over {len(rounds)} rounds")


def test_plot_writes_a_png(traced, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "trace.png"
    run = subprocess.run([sys.executable, "-m", "launcher.cli", "trace", str(traced.dir),
                          "--trace-id", traced.trace_id, "--out", str(out)],
                         env={**os.environ, **ENV}, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round" in run.stdout  # the per-round table

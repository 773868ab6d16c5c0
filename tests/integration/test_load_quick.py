"""The load benchmark's quick mode, end to end on the tiny models.

`python -m benchmarks.load --quick --tiny` starts a batched and an unbatched
stack (target, draft, orchestrator each, with metrics endpoints), runs N = 1
and 4 concurrent streams of every configuration and the in-process peer, and
writes JSON, Markdown and PNGs; its streams run multiplexed (GenerateMany). Checked here: the outputs exist, greedy
identity holds for every stream, and the identity check fails on a real
record with one token changed.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def load_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("load-quick")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # --multiplex: the streams share one GenerateMany stream per orchestrator, as the gateway's do.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.load", "--quick", "--tiny", "--ignore-eos",
                           "--multiplex", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc, out


def test_quick_load_benchmark_writes_its_outputs_and_keeps_greedy_identity(load_run) -> None:
    proc, out = load_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    result = json.loads((out / "results.json").read_text())
    ident = result["identity"]
    assert ident["passed"] is True and ident["mismatches"] == []
    modes = result["settings"]["modes"]
    assert result["settings"]["multiplex"] is True
    # Every service configuration at N = 1 and 4 on every stack, all compared.
    configs = result["settings"]["configs"]
    assert set(configs) >= {"target-only", "default", "adaptive", "draft-k4", "lookup-k4"}
    assert ident["compared"] == len(modes) * len(configs) * (1 + 4)
    cells = {(s["mode"], s["config"], s["n"]) for s in result["summaries"]}
    for mode in modes:
        for config in configs:
            assert {(mode, config, 1), (mode, config, 4)} <= cells
    assert {("peer", "hf-padded", 1), ("peer", "hf-padded", 4), ("peer", "hf-assisted-k4", 1)} <= cells
    for s in result["summaries"]:
        assert s["agg_tps"] > 0 and s["ttft_p50_ms"] > 0 and s["itl_p50_ms"] is not None, s
    # --ignore-eos: every stream exactly --max-new-tokens (12 in quick mode) long.
    assert all(len(st["token_ids"]) == 12 for r in result["records"] if r["mode"] != "peer"
               for st in r["streams"])
    for s in result["summaries"]:
        if s["mode"] == "batched" and s["n"] == 4:
            d = s["decode"]  # the decode phase, against the physical limit of the same streams
            assert d["tps"] > 0 and d["tokens"] > 0 and 0 < d["ideal_rows"] <= 4, s
            if s["config"] == "target-only":
                assert d["limit_tps"] > 0 and d["efficiency"] > 0 and 0 < d["rows"] <= 4, s
            parts = s["round_parts"]  # where a round's time goes
            assert parts["round"] > 0 and parts["target"] > 0, s
            cpu = s["cpu_us"]  # each process's CPU per stream-round; the target's passes read from it
            assert cpu["orchestrator"] > 0 and cpu["client"] > 0 and cpu["target_forward"] > 0, s
            assert cpu["target"] >= 0, s
            # The control plane's figures, loosely enough for a shared machine (measured about 500 µs
            # and 30-45% of the limit at N = 1): a round that idles or spins on it fails here.
            assert cpu["orchestrator"] < 10_000, s
            if s["config"] == "target-only":
                assert s["agg_tps"] >= 0.05 * (s["cell_limit_tps"] or 0), s
    adaptive = [s for s in result["summaries"] if s["config"] == "adaptive"]
    assert all(s["k_mean"] is not None and 0 <= s["k0_share"] <= 1 for s in adaptive)
    if result["settings"]["batching_flag"]:
        assert "unbatched" in modes
        # The services' batch histograms were read: the unbatched stack never forms a batch above 1.
        for s in result["summaries"]:
            rows = (s["batches"].get("target") or {}).get("batch_rows") or {}
            if s["mode"] == "unbatched" and rows.get("mean") is not None:
                assert rows["mean"] == 1.0, s
    assert {g["figure"] for g in result["goals"]} >= {"greedy identity (every stream = target-only alone)"}
    md = (out / "results.md").read_text()
    assert "## Goals" in md and "PASSED" in md and "| batched | target-only | 4 |" in md
    assert "CPU time per stream-round" in md
    for png in ("tps_vs_n.png", "ttft_vs_n.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    # The services' logs come with the results (the stacks' scratch folder is removed).
    for mode in modes:
        logs = {log.name for log in (out / "logs" / mode).glob("*.log")}
        assert {"target.log", "orchestrator.log"} <= logs, (mode, logs)


def test_identity_check_catches_a_changed_token(load_run) -> None:
    from benchmarks.load import report as load_report

    proc, out = load_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    records, reference = result["records"], result["reference"]
    assert load_report.identity_mismatches(records, reference) == []
    tampered = copy.deepcopy(records)
    record = next(r for r in tampered if r["mode"] == "batched" and r["config"] == "adaptive" and r["n"] == 4)
    stream = next(s for s in record["streams"] if len(s["token_ids"]) > 3)
    stream["token_ids"][3] += 1
    bad = load_report.identity_mismatches(tampered, reference)
    assert [(m["prompt_id"], m["config"], m["n"], m["first_difference"]) for m in bad] == [
        (stream["prompt_id"], "adaptive", 4, 3)]
    assert load_report.identity(tampered, reference)["passed"] is False

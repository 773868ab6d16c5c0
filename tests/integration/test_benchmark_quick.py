"""The benchmark's quick mode, end to end on the tiny models.

Starts the real stack (target, draft, two orchestrators, link emulators) via
`python -m benchmarks.run --quick --tiny` in a subprocess and checks what it
wrote: JSON with raw records and the greedy-identity verdict, the Markdown
report, the plots.
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
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench-quick")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--tiny", "--threads", "1",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )
    return proc, out


def test_quick_benchmark_writes_report_and_passes_greedy_identity(quick_run) -> None:
    proc, out = quick_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    result = json.loads((out / "results.json").read_text())

    checks = result["checks"]
    assert checks["greedy_passed"] is True
    assert checks["greedy_mismatches"] == []
    assert checks["greedy_compared"] > 0
    assert checks["prompt_token_mismatches"] == []

    env = result["environment"]
    for key in ("cpu", "torch", "transformers", "git_commit", "target_model", "draft_model"):
        assert env.get(key), key

    by_config = {(s["phase"], s["mode"], s["config"]) for s in result["summaries"]}
    for mode in ("greedy", "sampling"):
        assert ("main", mode, "svc-none") in by_config
        assert ("main", mode, "hf-target") in by_config
        assert any(c.startswith("svc-draft-k") for p, m, c in by_config if p == "main" and m == mode)
        assert ("main", mode, "svc-draft-auto") in by_config
        assert ("main", mode, "svc-default") in by_config
    # The predicted-output cell: the same edit prompt without and with a prediction.
    assert {c for p, _, c in by_config if p == "prediction"} == {
        "svc-none", "svc-prediction-source-k8", "svc-prediction-exact-k8"}
    # The structured-output cell: constrained target-only, draft k = 4, the default proposer.
    assert {c for p, _, c in by_config if p == "structured"} == {"svc-none", "svc-draft-k4", "svc-default"}
    assert any(p == "rtt" for p, _, _ in by_config)
    assert any(p == "rate" for p, _, _ in by_config)

    for s in result["summaries"]:
        assert s["reps"] == 3, s["config"]
        assert s["tps_median"] > 0, s["config"]
        assert s["tps_min"] <= s["tps_median"] <= s["tps_max"]
    drafts = [s for s in result["summaries"] if s["phase"] == "main" and s["proposer"] == "draft"]
    # Every speculative round commits >= 1 token, so passes per token never exceed 1.
    assert all(0 < s["passes_per_token"] <= 1.0 for s in drafts)
    assert all(s["breakdown"]["target_ms"]["median"] > 0 for s in drafts)
    for s in drafts:
        draft_ms = s["breakdown"]["draft_ms"]
        if s["config"] == "svc-draft-auto":
            # Goodput k may decide drafting does not pay on the tiny models (k = 0
            # rounds, probes only): the draft's time can be 0 in most rounds.
            assert draft_ms["mean"] >= 0, s["config"]
        elif s["config"].startswith("svc-draft-par"):
            assert draft_ms["mean"] > 0, s["config"]  # pre-draft hits hide some of it
        else:
            assert draft_ms["median"] > 0, s["config"]
    # Fixed-k configs still send their k (no round asks for more, and some ask for exactly
    # k); svc-draft-auto (k = 0) gets k chosen per round by the orchestrator.
    for s in drafts:
        if s["config"] == "svc-draft-auto":
            # Its k is the orchestrator's: on the tiny models the speculation gate may have
            # measured plain decoding faster (the default proposer's earlier cells teach it on
            # the same orchestrator) and kept every round at k = 0.
            assert s["k"] == 0 and 0 <= s["k_mean"] <= s["k_max"] <= 16
            assert s["hf_twin"] is None
            if s["k_max"]:
                assert s["acceptance_by_position"]
        else:
            assert s["k_max"] == s["k"] and s["k_mean"] <= s["k"], s["config"]
    auto = [r for r in result["records"] if r["config"] == "svc-draft-auto"]
    assert {r["mode"] for r in auto} == {"greedy", "sampling"}
    assert all(r["adaptive"] and r["k"] == 0 for r in auto)
    assert sum(1 for r in auto if r["mode"] == "greedy") == 3 * result["settings"]["n_prompts"]
    # ... and its greedy outputs equal target-only through the services, token for token.
    ref = {r["prompt_id"]: r["token_ids"] for r in result["records"] if r["mode"] == "greedy"
           and r["config"] == "svc-none" and r["phase"] == "main" and r["rep"] == 0}
    assert all(r["token_ids"] == ref[r["prompt_id"]] for r in auto if r["mode"] == "greedy")
    assert any(m and m["adaptive"] and m["adaptive"]["config"] == "svc-draft-auto"
               for m in result["models"])
    # The breakdown is over rounds (Stats.rounds), with serialization its own part.
    for s in (s for s in result["summaries"] if s["family"] == "svc"):
        b = s["breakdown"]
        assert b["per_round"] is True and b["rounds"] == s["target_passes"], s["config"]
        assert b["serialize_ms"]["median"] > 0, s["config"]
        assert 0 < b["non_compute_share"]["median"] < 1, s["config"]

    # An emulated RTT shows up as network time: ~RTT per RPC.
    rtt = {(s["rtt_ms"], s["config"]): s for s in result["summaries"] if s["phase"] == "rtt"}
    slow = rtt[(5.0, "svc-none")]["breakdown"]["network_ms"]["median"]
    fast = rtt[(0.0, "svc-none")]["breakdown"]["network_ms"]["median"]
    assert slow - fast > 3.5, (slow, fast)

    # The combined proposer's cell, and every main cell by prompt category against svc-none.
    combined = [r for r in result["records"] if r["config"] == "svc-combined-k4"]
    assert combined and all(r["token_ids"] == ref[r["prompt_id"]] for r in combined
                            if r["mode"] == "greedy" and r["phase"] == "main")
    sources = {rnd["source"] for r in combined for rnd in r["stats"]["rounds"]}
    # Its free sources: prompt lookup, and suffix decoding once a repetition's prompt was answered.
    assert sources <= {"", "draft", "lookup", "suffix"} and sources - {""}, sources
    by_cat = {(r["mode"], r["config"], r["category"]): r for r in result["by_category"]}
    categories = {r["category"] for r in result["records"] if r["phase"] == "main"}
    assert len(categories) >= 5
    for c in categories:
        assert by_cat[("greedy", "svc-none", c)]["vs_svc_none"] == 1.0
        assert by_cat[("greedy", "svc-combined-k4", c)]["tps_median"] > 0

    # Its outputs are valid for their schema and equal constrained target-only's, token for token.
    constrained = [r for r in result["records"] if r["phase"] == "structured"]
    assert len(constrained) == 3 * 3 * result["settings"]["structured_prompts"]
    own = {r["prompt_id"]: r["token_ids"] for r in constrained if r["config"] == "svc-none" and r["rep"] == 0}
    assert all(r["valid"] and r["token_ids"] == own[r["prompt_id"]] for r in constrained)
    for s in (s for s in result["summaries"] if s["phase"] == "structured"):
        assert s["valid"] == s["identical"] == s["requests"] == 3 * s["pairs"], s["config"]
        assert 0 < s["passes_per_token"] <= 1.0, s["config"]
    assert next(s for s in result["summaries"] if s["phase"] == "structured"
                and s["config"] == "svc-draft-k4")["passes_per_token"] < 1.0  # speculation paid

    md = (out / "results.md").read_text()
    assert "## Structured output" in md and "| svc-default | 3/3 | 3/3 |" in md
    assert "PASSED" in md and "| greedy | svc-none |" in md and "| greedy | svc-draft-auto |" in md
    assert "## By prompt category" in md and "| greedy | svc-combined-k4 |" in md
    for png in ("speedup_vs_k.png", "breakdown.png", "acceptance_by_position.png",
                "speedup_vs_rtt.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_greedy_identity_check_catches_a_changed_token(quick_run) -> None:
    """The check that guards the run must fail on a real record with one token changed."""
    from benchmarks.run import analysis

    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads((out / "results.json").read_text())["records"]
    assert analysis.greedy_mismatches(records) == []
    tampered = copy.deepcopy(records)
    victim = next(r for r in tampered if r["mode"] == "greedy" and r["config"].startswith("svc-draft")
                  and len(r["token_ids"]) > 3)
    victim["token_ids"][3] += 1
    bad = analysis.greedy_mismatches(tampered)
    assert [(m["prompt_id"], m["config"], m["first_difference"]) for m in bad] == [
        (victim["prompt_id"], victim["config"], 3)]


def test_quick_benchmark_with_a_feature_head(tmp_path) -> None:
    """The same harness with the draft a feature head: greedy identity holds, the RTT sweep runs it,
    and the feature bytes per round are in the figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--tiny", "--tiny-head", "--threads", "1",
         "--modes", "greedy", "--k", "2", "--parallel-k", "1", "--lookup-k", "", "--combined-k", "",
         "--no-auto", "--rtts", "0,5", "--rates", "0", "--prediction-prompts", "0", "--structured-prompts", "0",
         "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    assert "no hf-assisted configurations" in proc.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["checks"]["greedy_passed"] is True and result["checks"]["greedy_compared"] > 0
    drafted = [s for s in result["summaries"] if s["config"] == "svc-draft-k2"]
    assert {s["phase"] for s in drafted} >= {"main", "rtt"}
    for s in drafted:
        assert s["breakdown"]["feature_bytes_per_round"]["median"] > 0, s["phase"]
    assert "(features " in (tmp_path / "results.md").read_text()


def test_the_suffix_benchmark_on_tiny_models(tmp_path) -> None:
    """benchmarks.features.suffix end to end (4 requests per workload): every configuration's tokens
    are target-only's, and its report and JSON have a row per workload and configuration."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.features.suffix", "--tiny", "--requests", "4", "--measure", "2",
         "--max-new-tokens", "16", "--out", str(tmp_path)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    result = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(result) == {"extract", "edits"}
    for rows in result.values():
        assert {r["config"] for r in rows} == {"target-only", "lookup-k8", "suffix", "default"}
        assert all(r["identical"] == r["requests"] == 4 and r["tokens_per_pass"] >= 1.0 for r in rows)
    assert "| edits | suffix | 4/4 |" in (tmp_path / "results.md").read_text()

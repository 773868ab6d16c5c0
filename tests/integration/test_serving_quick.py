"""The serving benchmark's quick variant: guidellm 0.8.1 (`make guidellm`) with its defaults
against a real gateway in front of the tiny stack, target-only and the default configuration.

Every run must finish with >= 99% of its requests succeeding and exactly 64 output tokens in
each (guidellm sends `ignore_eos` and counts the tokens from the usage it streams), which is
what failed before the gateway spoke the dialect: 0 of N requests succeeded (400 on
`ignore_eos`, 404 on the model id guidellm takes from /v1/models).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.serving import bench
from tests.integration.stack import ENV, Stack


@pytest.fixture(scope="module")
def gateway(tiny_pair, tmp_path_factory):
    if not bench.available():
        if os.environ.get("CI"):
            pytest.fail(f"guidellm is not installed in {bench.GUIDELLM} (make test runs `make guidellm`)")
        pytest.skip("guidellm is not installed: run `make guidellm`")
    target_dir, draft_dir = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("serving-logs"))
    try:
        stack.start_service("target", "target", target_dir)
        stack.start_service("draft", "draft", draft_dir)
        stack.start_orchestrator("orch", target_dir)
        yield stack.start_gateway("orch"), target_dir
    finally:
        stack.stop()


def test_guidellm_quick_against_the_gateway(gateway, tmp_path):
    base, tokenizer = gateway
    out = tmp_path / "serving"
    done = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--gateway", base, "--quick",
                           "--tokenizer", str(tokenizer), "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=900)
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    runs = {(r["profile"], r["config"]) for r in result["runs"]}
    assert runs == {("concurrency 2", "none"), ("concurrency 2", "default")}
    for r in result["runs"]:
        assert r["successful"] > 0 and r["success_rate"] >= 0.99, r
        assert r["output_tokens_min"] == r["output_tokens_max"] == 64, r
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_s"]["p50"] * 1000 and r["itl_ms"]["p50"] > 0
    assert "| concurrency 2 | target-only |" in (out / "report.md").read_text()

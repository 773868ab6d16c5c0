"""scripts/gpu-check: its CPU dry run passes every phase, and without a GPU it says so at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
PHASES = ["env", "cached", "selfcheck", "invariance", "score_steps", "identity", "timing", "oom", "top_p"]


def test_the_cpu_dry_run_passes_every_phase(tmp_path: Path) -> None:
    assert os.access(SCRIPT, os.X_OK)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--device", "cpu", "--quick"],
                          capture_output=True, text=True, timeout=420)
    lines = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == PHASES
    failed = {r["phase"]: r.get("error", r) for r in lines if r["status"] != "passed"}
    assert not failed and proc.returncode == 0, (failed, proc.stdout[-2000:], proc.stderr[-2000:])
    by_phase = {r["phase"]: r for r in lines}
    assert by_phase["cached"]["argmax_flips"] == 0
    for dtype in ("fp32", "bf16", "fp16"):
        assert by_phase["selfcheck"][dtype]["runner"] == "PooledRunner", by_phase["selfcheck"][dtype]
        assert all(v["bitwise"] for v in by_phase["invariance"][dtype].values()), dtype
        assert by_phase["score_steps"][dtype]["bitwise"], dtype
    for dtype in ("bf16", "fp16"):
        for n, cell in by_phase["identity"][dtype].items():
            assert cell["identical"] == cell["sessions"] == int(n) and cell["tree_path_bitwise"] == int(n), cell
    assert by_phase["timing"]["engine_1x1_ms"] > 0 and by_phase["timing"]["stock_1x1_ms"] > 0
    assert "all passed" in (tmp_path / "report.md").read_text()


def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU: torch.cuda.is_available() is False" in proc.stderr
    assert "no CUDA GPU" in (tmp_path / "report.md").read_text()

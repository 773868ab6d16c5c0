"""scripts/gpu-check without a GPU: it stops at once, says why, and still writes its report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


def test_gpu_check_fails_clearly_without_a_gpu(tmp_path: Path) -> None:
    assert os.access(SCRIPT, os.X_OK)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "report")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU: torch.cuda.is_available() is False" in proc.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["verdict"] == "no GPU" and report["steps"] == []
    assert "no CUDA GPU" in (tmp_path / "report" / "report.md").read_text()


def test_gpu_check_usage() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 64 and "OUT_DIR" in proc.stderr

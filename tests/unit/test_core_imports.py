"""The core stays transport-free: importing it must not pull in grpc, protobuf or redis."""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import specdec.core

FORBIDDEN = ("grpc", "google.protobuf", "redis", "transformers")


def test_core_imports_no_transport_or_model_loading() -> None:
    modules = [m.name for m in pkgutil.iter_modules(specdec.core.__path__, "specdec.core.")]
    assert {"specdec.core.verify", "specdec.core.lookup", "specdec.core.sampling"} <= set(modules)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(n for n in sys.modules if any(n == f or n.startswith(f + '.') for f in {FORBIDDEN!r}))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"specdec.core imported: {result.stdout.strip()}"

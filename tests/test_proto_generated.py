"""The checked-in generated modules must be exactly what proto/ generates."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_generated_modules_match_proto_sources(tmp_path: Path) -> None:
    fresh = _load_generator().generate(tmp_path)
    assert fresh, "no .proto sources found"
    stale = []
    for path in fresh:
        rel = path.relative_to(tmp_path)
        checked_in = ROOT / rel
        if not checked_in.exists() or checked_in.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert not stale, f"regenerate with `python scripts/gen_proto.py`: stale {stale}"


def test_no_orphan_generated_modules(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path) for p in _load_generator().generate(tmp_path)}
    on_disk = {
        p.relative_to(ROOT)
        for p in (ROOT / "specdec" / "v1").iterdir()
        if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    }
    assert on_disk <= fresh, f"generated modules without a .proto: {sorted(map(str, on_disk - fresh))}"

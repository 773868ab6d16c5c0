"""Regenerate specdec/v1/*_pb2*.py from proto/specdec/v1/*.proto.

The .proto files are the single source; the generated modules are checked in
so a plain `pip install` needs no protoc. tests/unit/test_proto_generated.py
fails if the checked-in modules differ from a fresh generation.

    python scripts/gen_proto.py [OUT_DIR]
"""
from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto under proto/; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for source in sources:
        stem = out_dir / source[: -len(".proto")]
        written += [Path(f"{stem}{suffix}") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(target):
        print(path)

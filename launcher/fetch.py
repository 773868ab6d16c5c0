"""python -m launcher.fetch: put a Hugging Face model into the hub cache before its process starts.

Kubernetes' model-hub component (deploy/k8s/components/model-hub) runs it as an init container
with the Hub reachable and HF_TOKEN set; the service (or the orchestrator, --tokenizer-only) then
starts with HF_HUB_OFFLINE=1 and reads the same cache (HF_HOME on the pod's /cache volume), so
only the init container talks to the Hub and the serving process never waits on it.

The model and revision are the process's own settings, SPECDEC_MODEL and SPECDEC_REVISION (the
orchestrator's: SPECDEC_TOKENIZER and SPECDEC_TOKENIZER_REVISION), or --model / --revision. A
value that is not a Hub id fetches nothing and exits 0: empty (the embedded default), or a local
path (an existing path wins, as in the services). What is fetched is what serving reads (the
patterns of engine.model.hub): config, tokenizer and template files, the safetensors weights, or
the PyTorch .bin weights where a repository has no safetensors; --tokenizer-only skips weights.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

DEFAULT_REVISION = "main"
FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
WEIGHTS = ["*.safetensors"]
LEGACY_WEIGHTS = ["*.bin"]
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_id(spec: str) -> bool:
    """ORG/NAME: one slash, each part a plain name (not `/x`, `./x`, `~/x`, `a/../b`)."""
    parts = spec.split("/")
    return len(parts) == 2 and all(_PART.fullmatch(p) and ".." not in p for p in parts)


def fetch(spec: str, revision: str | None = None, *, weights: bool = True) -> Path | None:
    """The snapshot folder of `spec` at `revision`, downloaded into the hub cache; None when `spec`
    names no Hub model (empty, or an existing local path)."""
    if not spec or Path(spec).expanduser().exists() or not is_hub_id(spec):
        return None
    from huggingface_hub import snapshot_download

    revision = revision or DEFAULT_REVISION
    folder = Path(snapshot_download(spec, revision=revision, allow_patterns=FILES + (WEIGHTS if weights else [])))
    if weights and not any(folder.glob("*.safetensors")):
        folder = Path(snapshot_download(spec, revision=revision, allow_patterns=FILES + LEGACY_WEIGHTS))
    return folder


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer-only", action="store_true",
                   help="fetch config, tokenizer and template files only (the orchestrator's "
                        "--tokenizer); reads SPECDEC_TOKENIZER / SPECDEC_TOKENIZER_REVISION")
    p.add_argument("--model", default=None,
                   help="Hugging Face id ORG/NAME; default SPECDEC_MODEL (SPECDEC_TOKENIZER with "
                        "--tokenizer-only); empty or a local path: nothing to fetch")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit; default SPECDEC_REVISION (SPECDEC_TOKENIZER_REVISION "
                        "with --tokenizer-only), else main")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    prefix = "SPECDEC_TOKENIZER" if args.tokenizer_only else "SPECDEC_MODEL"
    revision_env = "SPECDEC_TOKENIZER_REVISION" if args.tokenizer_only else "SPECDEC_REVISION"
    spec = args.model if args.model is not None else os.environ.get(prefix, "")
    revision = args.revision or os.environ.get(revision_env) or DEFAULT_REVISION
    try:
        folder = fetch(spec.strip(), revision, weights=not args.tokenizer_only)
    except Exception as exc:  # noqa: BLE001 - one line for the pod's log, not a traceback
        detail = str(exc).splitlines()[0] if str(exc) else ""
        print(f"fetch: {spec} (revision {revision}) could not be fetched: {type(exc).__name__}: {detail} "
              "(gated or private: set HF_TOKEN; check the id, the revision and egress to the Hub)",
              file=sys.stderr)
        return 1
    if folder is None:
        print(f"fetch: {spec or '(empty: the embedded default)'} is not a Hugging Face id: nothing to fetch")
    else:
        print(f"fetch: {spec} (revision {revision}) -> {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

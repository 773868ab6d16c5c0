"""A Hugging Face hub cache on disk, as `hf download` leaves it, from a local model folder.

    HUB/models--ORG--NAME/blobs/<sha256>            the files' contents
    HUB/models--ORG--NAME/refs/main                 the commit main points at
    HUB/models--ORG--NAME/snapshots/<commit>/FILE   relative symlinks into blobs/

For tests that load models by id offline (HF_HUB_OFFLINE=1, HF_HUB_CACHE=HUB): nothing is fetched.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def publish(folder: Path, hub: Path, repo_id: str, *, commit: str | None = None,
            ref: str | None = "main") -> str:
    """Put `folder`'s files in the cache `hub` as `repo_id` at `commit` (named by `ref`); the commit."""
    repo = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    digest = hashlib.sha1(repo_id.encode())
    for path in files:
        digest.update(path.read_bytes())
    commit = commit or digest.hexdigest()  # 40 hex digits, as a git commit id
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit

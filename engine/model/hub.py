"""Models by name: a Hugging Face id (ORG/NAME) at a revision, as a snapshot folder in the hub cache.

An existing local path always wins (engine.model.loader); a value that is not one and is shaped
like an id (one slash, nothing leading: not `/x`, `./x`, `~/x`) names a model on the Hub. It is
resolved by `huggingface_hub.snapshot_download`, so the hub's own settings apply: HF_TOKEN (gated
and private models), HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE (never ask the
Hub: the cache alone). Only what serving reads is fetched: the config, tokenizer and template files
and the safetensors weights (the PyTorch `.bin` weights where a repository has no safetensors).

Where the model cannot be had (offline and not cached, the Hub unreachable, gated without a token,
no such id or revision), `ModelUnavailable` says what to do, in one line. No torch here.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_REVISION = "main"
FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]  # config, tokenizer, templates
WEIGHTS = ["*.safetensors"]
LEGACY_WEIGHTS = ["*.bin"]  # only where a repository has no safetensors
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TRUE = ("1", "on", "yes", "true")


class ModelUnavailable(FileNotFoundError):
    """A Hugging Face id that cannot be loaded here; the message says what to do instead."""


def is_hub_id(spec: str) -> bool:
    """True for a string shaped like ORG/NAME (one slash, no leading ./, / or ~)."""
    parts = spec.split("/")
    return len(parts) == 2 and all(_PART.fullmatch(p) and ".." not in p for p in parts)


def names_hub_model(spec: str | None) -> bool:
    """True when a --model value names a Hub model: not an existing local path, shaped like an id."""
    return bool(spec) and not Path(spec).expanduser().exists() and is_hub_id(spec)


def offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> str | None:
    """The hub cache the environment names now (HF_HUB_CACHE, else HF_HOME/hub); None: the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def _where() -> str:
    from huggingface_hub import constants

    return cache_dir() or constants.HF_HUB_CACHE


def _advice(repo_id: str, revision: str) -> str:
    return (f"download it where the Hub is reachable (hf download {repo_id} --revision {revision}; "
            "huggingface-cli download in older huggingface_hub) and mount that cache here "
            "(HF_HOME or HF_HUB_CACHE), or pass a local folder")


def snapshot(repo_id: str, revision: str | None = None, *, flag: str = "--model") -> Path:
    """The local snapshot folder of `repo_id` at `revision` (default main), fetched if needed;
    `flag` names the setting it came from in the error."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    revision = revision or DEFAULT_REVISION
    what = f"{flag} {repo_id} (revision {revision})"
    fetch = dict(revision=revision, cache_dir=cache_dir(), local_files_only=offline())
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=FILES + WEIGHTS, **fetch))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, allow_patterns=FILES + LEGACY_WEIGHTS, **fetch))
    except GatedRepoError:
        raise ModelUnavailable(f"{what} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                               "to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelUnavailable(f"{what}: no such model on the Hub (or it is private: set HF_TOKEN), "
                               "and it is not a local path either") from None
    except RevisionNotFoundError:
        raise ModelUnavailable(f"{what}: the Hub has no such revision (a branch, tag or commit)") from None
    except LocalEntryNotFoundError:
        reason = ("HF_HUB_OFFLINE is set" if offline() else "the Hub could not be reached")
        raise ModelUnavailable(f"{what} is not in the Hugging Face cache at {_where()} and {reason}: "
                               + _advice(repo_id, revision)) from None
    except Exception as exc:  # noqa: BLE001 - a proxy, TLS or HTTP failure: one line, not a traceback
        raise ModelUnavailable(f"{what} could not be fetched ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}): "
                               + _advice(repo_id, revision)) from None
    return folder

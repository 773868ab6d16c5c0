"""EAGLE-3 draft heads in their published layout, loaded as they are.

The layout EAGLE's and SpecForge's training write, and vLLM and SGLang serve:

  config.json   a Llama config of the head (hidden_size, heads, intermediate
                size, rope, rms_norm_eps, vocab_size = the target's) plus
                `draft_vocab_size` and, where given, the target layers it reads,
                in either of two conventions (aux_layers):
                `eagle_aux_hidden_state_layer_ids` at the top level (EAGLE's own
                key, the one vLLM reads): the layers whose incoming residual
                stream the head reads; `eagle_config.eagle_aux_hidden_state_layer_ids`
                (SpecForge's, which SGLang reads and adds 1 to): the layers whose
                output it reads, one less. Absent: layers 2, L // 2 and L - 3 of
                an L-layer target, EAGLE-3's own choice. `save` writes both.
  model.safetensors (or pytorch_model.bin, or shards named by model.safetensors.index.json)
                fc.weight       [H, n * H_target]  the n target layers -> H, no bias
                midlayer.*      one decoder layer whose q/k/v read 2H:
                                input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
                                post_attention_layernorm, mlp.{gate,up,down}_proj
                norm.weight     the final norm
                lm_head.weight  [draft_vocab_size, H] (absent: the target's rows for the
                                draft vocabulary, as vLLM and SGLang do)
                d2t             [draft_vocab_size] int64: draft id i is target id i + d2t[i]
                t2d             [vocab_size] bool (read, checked against d2t)
                embed_tokens.weight (optional; absent: the target's, from --base-model)

The head's step, at the token of position p: the feature `g` is fc(target
layers' residual streams entering the aux layers at position p - 1), or, past
the target's features, the head's own pre-norm output at p - 1; then
  x = [input_layernorm(embed(token)) ; hidden_norm(g)]    (2H, attention reads it)
  h = g + o_proj(attention(x));  h = h + mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h)) scattered to target ids by d2t (-inf elsewhere),
and h itself (before the norm) is the next step's g.

Here the head becomes an ordinary one-layer Llama module tree, so the engine's
pooled forward (engine.model.llama) serves it over the KV pool: layer 0's
q/k/v are 2H wide, it carries `hidden_norm`, `model.eagle3_fc` is fc and the
head is a drafts.SubsetHead over the d2t ids holding lm_head's rows.
`reference_logits` is the plain computation the engine's start-up check
compares against.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.model.drafts import SubsetHead

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3Speculator")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"  # sharded safetensors: its weight_map names the files
# config.json flags some trainers write that change the head's forward; the engine computes
# neither, so a head that turns one on is refused rather than served as another head.
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_output")


def is_eagle3_folder(path: Path) -> bool:
    """Whether `path` holds an EAGLE-3 head in the published layout (its config.json says so)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except ValueError:
        return False
    return bool(set(data.get("architectures") or ()) & set(ARCHITECTURES)) or "draft_vocab_size" in data


def aux_layers(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers the head reads (their incoming residual streams), checked against the target.

    The top-level `eagle_aux_hidden_state_layer_ids` names them as they are (EAGLE, vLLM); the
    nested `eagle_config.eagle_aux_hidden_state_layer_ids` names the layers whose output is read,
    one less (SpecForge writes [1, L/2 - 1, L - 4] for EAGLE-3's default; SGLang adds 1). Given
    both, they must name the same layers."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_nested = tuple(int(i) + 1 for i in nested) if nested else ()
    ids = tuple(int(i) for i in top) if top else from_nested
    if top and nested and ids != from_nested:
        raise ValueError(f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids {list(top)} (layers entered) and "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (layers' outputs, "
                         f"so layers {list(from_nested)} entered) disagree")
    if not ids:
        ids = (2, target_layers // 2, target_layers - 3)
    if any(not 0 <= i < target_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"EAGLE-3 head: aux layers {list(ids)} are not distinct layers of a "
                         f"{target_layers}-layer target")
    return ids


def aux_layer_fields(layers: Sequence[int]) -> dict[str, Any]:
    """config.json's fields naming `layers` (entered) so that every reader takes the same layers:
    the top-level key as they are (EAGLE, vLLM, specdec), the nested one as outputs (SpecForge,
    SGLang), which cannot name layer 0's input (the embeddings) and is then left out."""
    fields: dict[str, Any] = {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layers]}
    if all(int(i) >= 1 for i in layers):
        fields["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in layers]}
    return fields


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / SHARD_INDEX
    if index.is_file():
        from safetensors.torch import load_file

        shards = dict.fromkeys(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = [s for s in shards if not (folder / s).is_file()]
        if not shards or missing:
            raise FileNotFoundError(f"{folder}: {SHARD_INDEX} names shards that are not there: {missing or 'none'}")
        tensors = {}
        for shard in shards:
            tensors.update(load_file(str(folder / shard)))
        return {key.removeprefix("model."): value for key, value in tensors.items()}
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(str(file))
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        return {key.removeprefix("model."): value for key, value in tensors.items()}
    raise FileNotFoundError(f"{folder}: an EAGLE-3 head needs one of {', '.join(WEIGHT_FILES)} or {SHARD_INDEX}")


def head_config(base: Any) -> dict[str, Any]:
    """A fresh head's config.json fields for target config `base`: its width, heads, MLP and rope (one layer)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters", "attention_bias", "mlp_bias", "vocab_size", "pad_token_id", "bos_token_id",
            "eos_token_id")
    fields = {k: getattr(base, k) for k in keys if getattr(base, k, None) is not None}
    return {**fields, "num_hidden_layers": 1}


def build(raw: dict[str, Any], base: Any, draft_ids: torch.Tensor, embed: torch.Tensor,
          dtype: torch.dtype) -> tuple[Any, tuple[int, ...]]:
    """(the head's module tree, untrained but for its embedding, the target layers it reads), for config.json
    fields `raw`, target config `base`, the target ids of its draft vocabulary and the embedding it reads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    layers = aux_layers(raw, int(base.num_hidden_layers))
    hidden = int(raw["hidden_size"])
    target_hidden = int(raw.get("target_hidden_size") or base.hidden_size)
    vocab = int(raw.get("vocab_size") or base.vocab_size)
    if tuple(embed.shape) != (vocab, hidden):
        raise ValueError(f"the embedding is {tuple(embed.shape)}, the head needs ({vocab}, {hidden}) "
                         "(the target's vocabulary by the head's width)")
    if target_hidden != int(base.hidden_size):
        raise ValueError(f"the head reads {target_hidden}-wide target layers, the target's are {base.hidden_size}")
    if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab or draft_ids.unique().numel() != draft_ids.numel():
        raise ValueError(f"d2t maps the draft vocabulary outside [0, {vocab}) or onto one id twice")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config", "draft_vocab_size",
                                                           "target_hidden_size", "auto_map")}
    config = LlamaConfig(**{**fields, "num_hidden_layers": 1, "vocab_size": vocab, "tie_word_embeddings": True})
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(dtype)
    inner, layer = model.model, model.model.layers[0]
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None, dtype=dtype))
    layer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps).to(dtype)
    inner.eagle3_fc = torch.nn.Linear(len(layers) * target_hidden, hidden, bias=False, dtype=dtype)
    with torch.no_grad():
        inner.embed_tokens.weight.copy_(embed)
    model.lm_head = SubsetHead(inner.embed_tokens.weight, draft_ids.to(torch.long))
    return model, layers


def load(folder: Path, base: Any, base_embedding: Callable[[], torch.Tensor],
         dtype: torch.dtype, base_lm_head: Callable[[], torch.Tensor] | None = None) -> tuple[Any, tuple[int, ...]]:
    """(the head as a one-layer Llama module tree, the target layers it reads), from the published
    layout in `folder`; `base` is its target's config (layer count, width, vocabulary),
    `base_embedding` reads the target's input embedding and `base_lm_head` its lm_head, each
    asked only where the head holds none."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    flags = [f for f in UNSUPPORTED_FLAGS if raw.get(f)]
    if flags:
        raise ValueError(f"{folder}: {', '.join(f'{f}: true' for f in flags)} is not supported (the engine "
                         "computes the head without it, so it would draft as another head)")
    tensors = _read_weights(folder)
    vocab = int(raw.get("vocab_size") or base.vocab_size)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is None:
        embed = base_embedding()
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is None and base_lm_head is None:
        raise ValueError(f"{folder}: no lm_head.weight")
    draft_vocab = int(raw.get("draft_vocab_size") or (d2t.numel() if d2t is not None else 0)
                      or (lm_head.shape[0] if lm_head is not None else vocab))
    if d2t is None:
        d2t = torch.zeros(draft_vocab, dtype=torch.long)  # a full-vocabulary head: ids map to themselves
    ids = torch.arange(draft_vocab, dtype=torch.long) + d2t.to(torch.long)
    if lm_head is None:  # as vLLM and SGLang do: the target's own rows for the draft vocabulary
        full = base_lm_head()
        if full.shape[0] != vocab or int(ids.max()) >= vocab:
            raise ValueError(f"{folder}: no lm_head.weight, and the target's {tuple(full.shape)} does not "
                             f"cover the draft vocabulary")
        lm_head = full[ids.clamp(0, vocab - 1)]
        log.info("%s: no lm_head.weight; drafting with the target's lm_head rows", folder)
    if tuple(lm_head.shape) != (draft_vocab, int(raw["hidden_size"])) or ids.numel() != draft_vocab:
        raise ValueError(f"{folder}: lm_head.weight {tuple(lm_head.shape)} / d2t {tuple(d2t.shape)} do not fit "
                         f"draft_vocab_size {draft_vocab} x hidden {raw['hidden_size']}")
    if t2d is not None and (t2d.numel() != vocab or not bool(t2d.bool()[ids.clamp(0, vocab - 1)].all())
                            or int(t2d.bool().sum()) != draft_vocab):
        raise ValueError(f"{folder}: t2d does not mark exactly the ids d2t maps to")
    try:
        model, layers = build(raw, base, ids, embed, dtype)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    inner = model.model
    renamed = {"fc.weight": "eagle3_fc.weight"}
    state = {renamed.get(k, k.replace("midlayer.", "layers.0.", 1)): v for k, v in tensors.items()}
    own = dict(inner.named_parameters())
    own.pop("embed_tokens.weight")
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"{folder}: not an EAGLE-3 head this loader knows (missing {missing[:4]}, "
                         f"unexpected {extra[:4]})")
    with torch.no_grad():
        for name, value in state.items():
            if tuple(own[name].shape) != tuple(value.shape):
                raise ValueError(f"{folder}: {name} is {tuple(value.shape)}, expected {tuple(own[name].shape)}")
            own[name].copy_(value)
        model.lm_head.sub_weight.copy_(lm_head)
    model.requires_grad_(False)
    log.info("EAGLE-3 head %s: reads target layers %s, draft vocabulary %d of %d", folder, list(layers),
             draft_vocab, vocab)
    return model, layers


def save(model: Any, layers: Sequence[int], folder: Path, dtype: torch.dtype,
         extra: dict[str, Any] | None = None) -> Path:
    """Write `model` (from build) in the published layout: config.json and model.safetensors (fc, midlayer,
    norm, lm_head, d2t, t2d; no embedding: the target's is read at load). `extra`: more config.json fields."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inner, head = model.model, model.lm_head
    ids = head.subset.to("cpu", torch.long)
    config = model.config
    raw = {**head_config(config), "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "draft_vocab_size": int(ids.numel()), "target_hidden_size": int(inner.eagle3_fc.in_features // len(layers)),
           **aux_layer_fields(layers), "torch_dtype": str(dtype).removeprefix("torch."), **(extra or {})}
    raw["vocab_size"] = int(inner.embed_tokens.weight.shape[0])
    tensors = {"fc.weight": inner.eagle3_fc.weight, "norm.weight": inner.norm.weight,
               "lm_head.weight": head.sub_weight}
    tensors |= {f"midlayer.{k}": v for k, v in inner.layers[0].named_parameters()}
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    tensors["d2t"] = ids - torch.arange(ids.numel(), dtype=torch.long)
    t2d = torch.zeros(raw["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def serving_dtype(folder: Path, device: str | torch.device) -> str:
    """The dtype to serve a published head in when none is asked for: its config's torch_dtype where the
    device computes it (engine.model.dtypes.fast_on), else float32."""
    from engine.model.dtypes import DTYPES, fast_on

    stored = str(json.loads((Path(folder) / "config.json").read_text()).get("torch_dtype") or "float32")
    stored = stored.removeprefix("torch.")
    return fast_on(stored, device) if stored in DTYPES else "float32"


def is_eagle3(model: Any) -> bool:
    return isinstance(getattr(getattr(model, "model", None), "eagle3_fc", None), torch.nn.Linear)


def feature_dim(model: Any) -> int:
    """The width of the target features the head reads on the wire (all its layers side by side)."""
    return int(model.model.eagle3_fc.in_features)


def reference_logits(model: Any, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The head's logits [T, vocab] over one sequence, every token reading the target's features.

    ids [T]; features [T, n * H_target]: row t the target layers' streams at the position before
    ids[t]. Plain torch (causal softmax attention), for the engine's start-up check.
    """
    inner, layer = model.model, model.model.layers[0]
    attn = layer.self_attn
    dtype = inner.eagle3_fc.weight.dtype
    g = inner.eagle3_fc(features.to(dtype))
    x = torch.cat([layer.input_layernorm(inner.embed_tokens(ids)), layer.hidden_norm(g)], dim=-1)
    t = ids.shape[0]
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    hd = getattr(model.config, "head_dim", None) or model.config.hidden_size // heads
    q = attn.q_proj(x).view(t, heads, hd).transpose(0, 1)
    k = attn.k_proj(x).view(t, kv_heads, hd).transpose(0, 1)
    v = attn.v_proj(x).view(t, kv_heads, hd).transpose(0, 1)
    cos, sin = inner.rotary_emb(x[None], torch.arange(t, device=ids.device)[None])
    cos, sin = cos[0], sin[0]

    def rotate(y: torch.Tensor) -> torch.Tensor:
        half = y.shape[-1] // 2
        return y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(heads // kv_heads, dim=0)
    v = v.repeat_interleave(heads // kv_heads, dim=0)
    scores = (q @ k.transpose(1, 2)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, heads * hd)
    h = g + attn.o_proj(o)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h))

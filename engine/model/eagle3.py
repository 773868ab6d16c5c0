"""EAGLE-3 draft heads as their trainers write them, loaded as they are (docs/operations.md lists
the formats and what each key means).

Two layouts:
  * the published one (EAGLE's and SpecForge's training; vLLM and SGLang serve it): a Llama
    config.json plus `draft_vocab_size` and the target layers read, in either convention
    (aux_layers: top-level ids name the layers entered, as EAGLE and vLLM read them;
    SpecForge's nested `eagle_config` ids their outputs, one less; absent: 2, L // 2, L - 3);
    weights fc.weight [H, n H_target], midlayer.* (q/k/v read 2H, hidden_norm), norm.weight,
    lm_head.weight [draft_vocab, H] (absent: the target's rows), d2t (draft id i is target id
    i + d2t[i]), t2d, embed_tokens.weight (absent: the target's, from --base-model); sharded
    safetensors too;
  * `speculators`' (vLLM's speculator library, its Eagle3DraftModel.save_pretrained): the layer's
    config nested under `transformer_layer_config` (a Llama or Qwen3 layer, whose q/k norms the
    engine applies), top-level aux ids (layers entered) and flags, the layer named `layers.0.*`.
`norm_before_residual`, `norm_before_fc` (one RMSNorm over the target layers side by side before fc)
and `fc_norm` (one per layer) are computed; `norm_output` and heads of more than one layer are
refused in one line.

The head's step, at the token of position p: the feature `g` is fc(target
layers' residual streams entering the aux layers at position p - 1), or, past
the target's features, the head's own pre-norm output at p - 1; then
  x = [input_layernorm(embed(token)) ; hidden_norm(g)]    (2H, attention reads it)
  h = g (or hidden_norm(g)) + o_proj(attention(x));  h = h + mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h)) scattered to target ids by d2t (-inf elsewhere),
and h itself (before the norm) is the next step's g. Position 0 (no feature precedes its token)
is fed but no later position attends to it: EAGLE, vLLM and speculators never feed it.

Here the head becomes an ordinary one-layer decoder module tree, so the engine's
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

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3Speculator",
                 "Eagle3DraftModel", "Eagle3Speculator")
LAYER_TYPES = ("llama", "qwen3")  # the decoder layers a head may use (its q/k/v read 2H)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"  # sharded safetensors: its weight_map names the files
# config.json flags some trainers write that change the head's forward; the engine computes
# neither, so a head that turns one on is refused rather than served as another head.
UNSUPPORTED_FLAGS = ("norm_output",)


def is_eagle3_folder(path: Path) -> bool:
    """Whether `path` holds an EAGLE-3 head in the published layout (its config.json says so)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except ValueError:
        return False
    return (bool(set(data.get("architectures") or ()) & set(ARCHITECTURES)) or "draft_vocab_size" in data
            or data.get("speculators_model_type") == "eagle3")


def flat_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as one level: a `speculators` head's `transformer_layer_config` lifted beside its own
    fields (draft_vocab_size, aux ids, flags); a head in the published layout as it is."""
    if raw.get("speculators_model_type") not in (None, "eagle3"):
        raise ValueError(f"a speculators {raw['speculators_model_type']!r} model, not an EAGLE-3 head")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return raw
    own = {k: v for k, v in raw.items() if k not in ("transformer_layer_config", "speculators_config",
                                                      "architectures", "auto_map", "model_type")}
    flat = {**layer, **{k: v for k, v in own.items() if v is not None}}
    flat["model_type"] = layer.get("model_type", "qwen3")  # speculators' own default layer config
    if "vocab_size" in layer:
        flat["vocab_size"] = layer["vocab_size"]
    return flat


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
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kind = str(raw.get("model_type") or "llama")
    if kind not in LAYER_TYPES:
        raise ValueError(f"a {kind!r} decoder layer (heads of {', '.join(LAYER_TYPES)} layers are served)")
    if int(raw.get("num_hidden_layers") or 1) != 1:
        raise ValueError(f"{raw['num_hidden_layers']} decoder layers (one-layer heads are served)")
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
                                                           "target_hidden_size", "auto_map", "model_type",
                                                           "layer_types", "sliding_window", "use_sliding_window")}
    config = AutoConfig.for_model(kind, **{**fields, "num_hidden_layers": 1, "vocab_size": vocab,
                                           "tie_word_embeddings": True})
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.norm_before_residual = bool(raw.get("norm_before_residual"))  # the residual: hidden_norm(g)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    inner, layer = model.model, model.model.layers[0]
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None, dtype=dtype))
    layer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps).to(dtype)
    inner.eagle3_fc = torch.nn.Linear(len(layers) * target_hidden, hidden, bias=False, dtype=dtype)
    eps = float(raw.get("rms_norm_eps") or 1e-6)
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise ValueError("norm_before_fc and fc_norm together (speculators refuses them too)")
    if raw.get("norm_before_fc"):  # speculators' input_norm: over the layers side by side
        inner.eagle3_input_norm = LlamaRMSNorm(len(layers) * target_hidden, eps=eps).to(dtype)
    if raw.get("fc_norm"):  # one norm per target layer's block
        inner.eagle3_fc_norms = torch.nn.ModuleList(
            [LlamaRMSNorm(target_hidden, eps=eps).to(dtype) for _ in layers])
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
    try:
        raw = flat_config(json.loads((folder / "config.json").read_text()))
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    flags = [f for f in UNSUPPORTED_FLAGS if raw.get(f)]
    if flags:
        raise ValueError(f"{folder}: {', '.join(f'{f}: true' for f in flags)} is not supported (the engine "
                         "computes the head without it, so it would draft as another head)")
    tensors = _read_weights(folder)
    for unused in ("verifier_norm.weight", "verifier_lm_head.weight"):  # a speculators head's training copies
        tensors.pop(unused, None)
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
    renamed = {"fc.weight": "eagle3_fc.weight", "input_norm.weight": "eagle3_input_norm.weight"}
    state = {renamed.get(k, k.replace("midlayer.", "layers.0.", 1).replace("fc_norm.", "eagle3_fc_norms.", 1))
             : v for k, v in tensors.items()}
    if hasattr(inner, "eagle3_input_norm"):  # speculators may leave it out: its initial ones
        state.setdefault("eagle3_input_norm.weight", inner.eagle3_input_norm.weight.detach().clone())
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


def fc_input(model: Any, features: torch.Tensor) -> torch.Tensor:
    """The target layers' features [n, len(layers) * H_target] as fc reads them: normed where the head
    has norm_before_fc (one norm over them all) or fc_norm (one per layer), else as they are."""
    inner = model.model
    if hasattr(inner, "eagle3_input_norm"):
        features = inner.eagle3_input_norm(features)
    norms = getattr(inner, "eagle3_fc_norms", None)
    if norms is not None:
        features = torch.cat([norm(block) for norm, block in zip(norms, features.chunk(len(norms), dim=-1))], dim=-1)
    return features


def reference_logits(model: Any, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The head's logits [T, vocab] over one sequence, every token reading the target's features.

    ids [T]; features [T, n * H_target]: row t the target layers' streams at the position before
    ids[t]. Plain torch (causal softmax attention; no row past 0 reads position 0), for the engine's
    start-up check.
    """
    inner, layer = model.model, model.model.layers[0]
    attn = layer.self_attn
    dtype = inner.eagle3_fc.weight.dtype
    g = inner.eagle3_fc(fc_input(model, features.to(dtype)))
    x = torch.cat([layer.input_layernorm(inner.embed_tokens(ids)), layer.hidden_norm(g)], dim=-1)
    t = ids.shape[0]
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    hd = getattr(model.config, "head_dim", None) or model.config.hidden_size // heads
    q = attn.q_proj(x).view(t, heads, hd)
    k = attn.k_proj(x).view(t, kv_heads, hd)
    if hasattr(attn, "q_norm"):  # a Qwen3 layer
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(0, 1), k.transpose(0, 1)
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
    hidden = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
    hidden[1:, 0] = True  # position 0 is never read (the module doc)
    scores = scores.masked_fill(hidden, float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, heads * hd)
    h = (layer.hidden_norm(g) if getattr(model.config, "norm_before_residual", False) else g) + attn.o_proj(o)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h))

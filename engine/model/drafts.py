"""Drafts made from a target: early exit (its first N layers) and the
distilled-draft folder format, shared by serving (the loader) and training
(distill), so serving never imports training.

Two kinds of distilled draft (Manifest.kind):
  * "layers": the target's embedding, its first L decoder layers (trained),
    its final norm (trained) and its tied head (frozen), optionally restricted
    to a vocabulary subset. It reads token ids only.
  * "eagle" (a feature head): reads [token embedding; target feature] through
    `model.model.fc` (2H -> H, trained) into L decoder layers (trained,
    initialised from the target's last L layers) and a final norm (trained),
    then the target's frozen tied head (optionally a subset). The feature that
    comes with the token at absolute position p is the target's final hidden
    state at position p - 1 after its final norm (what the LM head reads;
    zeros at p = 0). The head's own output after its norm predicts the
    target's feature at p, and drafting feeds it back as the next input
    feature (`head_hidden` is the reference computation; the engine's
    forward, engine.model.llama, is the serving one).

A draft folder holds only what training changed, plus a manifest:
  specdec-draft.json   format, base target, layers, vocabulary subset size, recipe, eval
  draft.safetensors    model.layers.*, model.norm.weight, and `vocab_subset` (int64 ids) if any
The frozen embedding/head come from the target at load time, so a draft of a
135M target is ~14 MB (bf16) instead of 270 MB. engine.model.loader loads
such a folder like any model (the manifest selects this path).

Reduced vocabulary: the head keeps only the rows of the N most frequent tokens
of the distillation data. Logits outside the subset are -inf, so the draft's
q is exactly 0 there; rejection sampling stays exact (a token the draft never
proposes is covered by the recovered distribution norm(max(0, p - q))), and
the draft service still returns full-vocabulary q rows.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.model.dtypes import DTYPES, fast_on

MANIFEST = "specdec-draft.json"  # marks a draft folder; the loader serves any folder holding it
WEIGHTS = "draft.safetensors"
FORMAT = "specdec-draft/1"
EMBEDDED = "embedded default"
LAYERS, EAGLE = "layers", "eagle"  # Manifest.kind
KINDS = (LAYERS, EAGLE)


class SubsetHead(torch.nn.Module):
    """A tied LM head over a vocabulary subset; -inf logits elsewhere.

    `weight` is the full (shared, frozen) embedding, so the head still reports
    the full vocabulary size; `sub_weight` holds the subset's rows.
    """

    def __init__(self, weight: torch.nn.Parameter, subset: torch.Tensor):
        super().__init__()
        self.weight = weight  # [vocab, hidden], shared with the input embedding
        self.register_buffer("subset", subset.to(device=weight.device, dtype=torch.long))  # [n]
        self.register_buffer("sub_weight", weight.detach()[self.subset].clone())  # [n, hidden]

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., n]
        return torch.nn.functional.linear(hidden, self.sub_weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., vocab]
        sub = self.subset_logits(hidden)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.subset] = sub
        return out


@dataclass(frozen=True)
class Manifest:
    """What specdec-draft.json says about a draft folder."""

    target: str  # EMBEDDED, or the path of the target folder / .gguf file
    target_name: str
    tokenizer_fingerprint: str
    num_layers: int
    vocab_subset: int  # rows of the reduced head; 0 = full vocabulary
    dtype: str  # dtype of the stored tensors (and the suggested serving dtype)
    format: str = FORMAT
    recipe: dict[str, Any] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)
    kind: str = LAYERS  # LAYERS or EAGLE (a manifest without it: LAYERS)

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        data = json.loads((Path(folder) / MANIFEST).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{folder / MANIFEST}: unknown format {data.get('format')!r}, expected {FORMAT!r}")
        if data.get("kind", LAYERS) not in KINDS:
            raise ValueError(f"{folder / MANIFEST}: unknown kind {data['kind']!r}, expected one of {KINDS}")
        return cls(**data)


def is_draft_folder(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def target_spec(target: str | None) -> str:
    """The manifest's name for a --target value (None/"default" = the embedded model)."""
    if not target or target == "default":
        return EMBEDDED
    return str(Path(target).expanduser().resolve())


def load_target_spec(spec: str) -> str | None:
    """The loader's spec for a manifest target (None = the embedded default)."""
    return None if spec == EMBEDDED else spec


def truncate_layers(model: Any, num_layers: int, *, last: bool = False) -> None:
    """Keep only the first (or with `last`, the last) `num_layers` decoder layers (early exit).

    The final norm and the LM head stay, so the result is a complete (weaker)
    causal LM over the same vocabulary. Works for Llama-like models whose
    decoder layers live in `model.model.layers`.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot truncate layers (no model.layers)")
    if not 0 < num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}], got {num_layers}")
    kept = slice(len(layers) - num_layers, None) if last else slice(num_layers)
    model.model.layers = torch.nn.ModuleList(list(layers)[kept])
    for index, layer in enumerate(model.model.layers):  # the KV-cache layer index of each
        if hasattr(getattr(layer, "self_attn", None), "layer_idx"):
            layer.self_attn.layer_idx = index
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = list(model.config.layer_types)[kept]


def _train_only_the_draft(model: Any, subset: torch.Tensor | None) -> Any:
    """Freeze the embedding and the head (a SubsetHead over `subset` if given); the rest trains."""
    if subset is not None:
        model.lm_head = SubsetHead(model.get_input_embeddings().weight, subset)
    model.requires_grad_(False)
    for p in trainable_parameters(model):
        p.requires_grad_(True)
    return model


def build_from_target(model: Any, num_layers: int, subset: torch.Tensor | None) -> Any:
    """Turn a loaded target model into an (untrained) draft, in place.

    Keeps the first `num_layers` decoder layers; freezes the embedding and the
    head; with `subset`, swaps the head for a SubsetHead over those token ids.
    """
    truncate_layers(model, num_layers)
    return _train_only_the_draft(model, subset)


def build_feature_head(model: Any, num_layers: int, subset: torch.Tensor | None) -> Any:
    """Turn a loaded target model into an (untrained) EAGLE-style feature head, in place.

    Keeps the target's LAST `num_layers` decoder layers (they already work on
    late features), adds `model.model.fc` (Linear 2H -> H with bias, starting
    as embedding + feature), keeps the final norm; freezes the embedding and
    the head; with `subset`, a SubsetHead over those ids.
    """
    truncate_layers(model, num_layers, last=True)
    hidden = int(model.get_input_embeddings().weight.shape[1])
    param = next(model.parameters())
    fc = torch.nn.Linear(2 * hidden, hidden, bias=True, device=param.device, dtype=param.dtype)
    with torch.no_grad():
        eye = torch.eye(hidden, device=param.device, dtype=param.dtype)
        fc.weight.copy_(torch.cat([eye, eye], dim=1))
        fc.bias.zero_()
    model.model.fc = fc
    return _train_only_the_draft(model, subset)


def is_feature_head(model: Any) -> bool:
    """Whether `model` is a feature head (reads target features next to its tokens)."""
    return isinstance(getattr(getattr(model, "model", None), "fc", None), torch.nn.Linear)


def feature_dim(model: Any) -> int:
    """The width of the target features a feature head reads (0: not a feature head)."""
    return int(model.model.fc.out_features) if is_feature_head(model) else 0


def head_hidden(model: Any, ids: torch.Tensor, features: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Reference forward of a feature head: ids [B, T], features [B, T, H] -> its normed hidden [B, T, H].

    features[:, t] is the target's feature of the position before ids[:, t]
    (zeros at absolute position 0). The result's row t predicts the target's
    feature at t; `model.lm_head(result)` gives the draft's logits for the
    token after ids[:, t]. Used by training and by the start-up check of the
    engine's forward.
    """
    x = model.model.fc(torch.cat([model.get_input_embeddings()(ids), features.to(model.model.fc.weight.dtype)], -1))
    out = model.model(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def target_features(model: Any, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, layers: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """The target's features, [B, T, n x H] (what Score returns): per entry of `layers` its final hidden state
    after the final norm (-1), or the residual stream entering that decoder layer, side by side."""
    deep = layers != (-1,)
    out = model.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                      output_hidden_states=deep)
    if not deep:
        return out.last_hidden_state
    return torch.cat([out.last_hidden_state if i == -1 else out.hidden_states[i] for i in layers], dim=-1)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for _, p in trainable_named(model)]


def trainable_named(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The decoder layers, the final norm and a feature head's fc (an EAGLE-3 head's too, and its own head
    rows where they are a parameter: engine.model.eagle3): everything but the shared embedding."""
    return [
        (name, p) for name, p in model.named_parameters()
        if name.startswith(("model.layers.", "model.norm.", "model.fc.", "model.eagle3_fc.", "lm_head.sub_weight"))
    ]


def subset_of(model: Any) -> torch.Tensor | None:
    head = model.get_output_embeddings()
    return head.subset if isinstance(head, SubsetHead) else None


def save(model: Any, folder: Path, manifest: Manifest) -> Path:
    """Write the trained tensors (in manifest.dtype) and the manifest to `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[manifest.dtype]
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in trainable_named(model)}
    subset = subset_of(model)
    if subset is not None:
        tensors["vocab_subset"] = subset.detach().to("cpu", torch.long).contiguous()
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt", "specdec": FORMAT})
    manifest.write(folder)
    return folder


def load_trained(model: Any, folder: Path) -> Any:
    """Build the draft from a loaded target `model` (in place) with `folder`'s tensors."""
    from safetensors.torch import load_file

    manifest = Manifest.read(folder)
    tensors = load_file(str(Path(folder) / WEIGHTS))
    subset = tensors.pop("vocab_subset", None)
    if manifest.vocab_subset and (subset is None or subset.numel() != manifest.vocab_subset):
        raise ValueError(f"{folder}: manifest says vocab_subset={manifest.vocab_subset}, tensors disagree")
    if manifest.kind == EAGLE:
        build_feature_head(model, manifest.num_layers, subset)
    else:
        build_from_target(model, manifest.num_layers, subset)
    expected = {name for name, _ in trainable_named(model)}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"{folder / WEIGHTS}: tensors do not fit the target (missing {missing[:3]}, extra {extra[:3]})")
    params = dict(trainable_named(model))
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    return model


def serving_dtype(folder: Path, device: str | torch.device) -> str:
    """The dtype to serve `folder` in when none is asked for: the draft's own where the device has it
    (a published EAGLE-3 head's: engine.model.eagle3.serving_dtype)."""
    if not is_draft_folder(folder):
        return "float32"
    return fast_on(Manifest.read(folder).dtype, device)

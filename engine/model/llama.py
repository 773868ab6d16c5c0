"""The engine's own forward for Llama-family decoders, over the KV pool.

Why not the model's own forward: transformers runs one batch of equal-length
rows over its own cache objects; the engine packs rows of different sessions
(different lengths, 1 to 64 new tokens each) into one token axis over one KV
pool (engine.pool) with one attention call per group of rows
(engine.model.attention). This module is that forward, in the open, for the
architectures it knows, reusing the loaded model's own weights, norm modules and
rotary embedding, so its numerics are the model's:

  * Llama, Mistral, and Qwen2 with its q/k/v biases: RMSNorm, rotary embeddings,
    grouped-query attention, a gated MLP;
  * Qwen3: the same with an RMSNorm over each head's queries and keys (q_norm,
    k_norm) before the rotary embedding;
  * Gemma 2 and 3: scaled embeddings (inside their embedding module), norms
    around both the attention and the MLP (post_attention_layernorm on the
    attention's output, pre/post_feedforward_layernorm around the MLP), q/k norms
    (Gemma 3), attention scaled by query_pre_attn_scalar, and per-type rotary
    embeddings (Gemma 3's local and global bases);
  * sliding-window layers (Gemma 2/3's local layers, Mistral, Qwen2/3 where the
    config turns it on): each lane attends to its last `sliding_window` keys
    (engine.model.attention.attend's window).

Attention logit soft-capping (Gemma 2's checkpoints) is not one SDPA call, so such
models are refused; a final logit soft-cap is applied. Anything else is served
by the stock forward (engine.stock) with a log line saying why.

Per layer, in packed [T, ...] form: norm -> one fused q|k|v product -> (q/k
norms) -> rotary -> write K/V to the pool -> grouped attention -> o product
(-> post-attention norm) (+ residual) -> norm -> one fused gate|up product ->
act(gate) * up -> down product (-> post-MLP norm) (+ residual).
The products are engine.model.linear.InvariantLinear (batch-invariant kernels).

`compile=True` (--compile) hands the norms and the gated activation to
torch.compile (dynamic shapes; CUDA graphs through mode "reduce-overhead" on a
GPU, where the runner's token buckets keep the shapes few). The products stay
eager: inductor cannot lower the prepacked oneDNN linear with dynamic token
counts. Off by default: on this project's CPU it measured slower (a lone
SmolLM2 decode 99 vs 90 ms, after 37 s of compiling); on a GPU,
launcher.gpucheck times it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.attention import AttentionPlan, attend, attention_dtype
from engine.model.eagle3 import fc_input
from engine.model.linear import InvariantLinear, fused, onednn_available
from engine.pool import KVPool

SUPPORTED = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text")
LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
FINAL = -1  # LlamaForward.step's hidden_layers: the final state (engine.plan.LAST)


def unsupported(model: torch.nn.Module) -> str:
    """Why this forward cannot serve `model` ("" if it can): a structural check."""
    config = model.config
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        return f"model type {kind!r} (the engine's forward knows {', '.join(SUPPORTED)})"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and set(layer_types) - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(set(layer_types))}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "norm"):
        return "no model.layers / rotary_emb / norm"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(
                isinstance(getattr(attn, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer without q/k/v/o linear projections"
        if not all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer without a gated MLP"
        extra = {n for n, _ in attn.named_children()} - ATTENTION_PARTS
        if extra:
            return f"attention submodules the engine does not apply: {sorted(extra)}"
        extra = {n for n, _ in layer.named_children()} - LAYER_PARTS - (
            {"hidden_norm"} if hasattr(inner, "eagle3_fc") else set())  # an EAGLE-3 head's layer 0 reads it
        if extra:
            return f"decoder-layer submodules the engine does not apply: {sorted(extra)}"
        if getattr(attn, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            return "attention logit soft-capping"
    return ""


def sliding_window(model: torch.nn.Module, index: int) -> int | None:
    """Layer `index`'s attention window in keys (None: every earlier key), as the model's own forward
    passes it to its attention: the attention module's `sliding_window` where it has one (Qwen2/3,
    Gemma 2/3: set on their sliding layers only), else the config's (Mistral: every layer)."""
    attn = model.model.layers[index].self_attn
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    else:
        config = model.config
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return int(window) if window else None


@dataclass
class _Layer:
    attn_norm: torch.nn.Module
    qkv: InvariantLinear
    o: InvariantLinear
    mlp_norm: torch.nn.Module
    gate_up: InvariantLinear
    down: InvariantLinear
    act: torch.nn.Module
    q_width: int
    kv_width: int
    scaling: float
    q_norm: torch.nn.Module | None = None  # Qwen3, Gemma 3: RMSNorm over each head's queries / keys
    k_norm: torch.nn.Module | None = None
    attn_out_norm: torch.nn.Module | None = None  # Gemma: on the attention's output, before the residual
    mlp_out_norm: torch.nn.Module | None = None  # Gemma: on the MLP's output, before the residual
    window: int | None = None  # sliding-window layer: each lane's last `window` keys
    rope: str | None = None  # per-type rotary embeddings (Gemma 3): this layer's type


class Head:
    """The LM head over the emitted positions: a full-vocabulary product, or a subset one scattered into -inf."""

    def __init__(self, module: torch.nn.Module, *, onednn: bool, softcap: float = 0.0):
        subset = getattr(module, "subset", None)
        weight = module.sub_weight if subset is not None else module.weight
        self.linear = InvariantLinear(weight, getattr(module, "bias", None), onednn=onednn)
        self.subset = subset
        self.vocab = int(module.weight.shape[0])
        self.softcap = softcap  # > 0: logits soft-capped to (-softcap, softcap), as Gemma 2's final logits

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [K, hidden] -> [K, vocab]
        logits = self.linear(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.subset is None:
            return logits
        out = logits.new_full((h.shape[0], self.vocab), float("-inf"))
        out[:, self.subset] = logits
        return out


class LlamaForward:
    """Packed forward over the pool: token ids + positions + attention plan -> the emitted logits."""

    def __init__(self, model: torch.nn.Module, *, compile: bool = False):
        reason = unsupported(model)
        if reason:
            raise ValueError(reason)
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        onednn = onednn_available(self.dtype, self.device)
        self.onednn = onednn
        # Attention's compute dtype (engine.model.attention; the start-up check may widen it to float32).
        self.attention_dtype = attention_dtype(self.dtype, self.device)
        self.multi_query = False  # True: --no-batch-invariant's attention (engine.model.attention)
        self.attention_threads = 0  # > 0: attention's CPU threads (the start-up check may set 1)
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        # A feature head (engine.model.drafts.build_feature_head): its input is fc([embedding; feature]).
        fc = getattr(inner, "fc", None)
        self.fc = InvariantLinear(fc.weight, fc.bias, onednn=onednn) if isinstance(fc, torch.nn.Linear) else None
        # An EAGLE-3 head (engine.model.eagle3): its layer 0 reads [norm(embedding); hidden_norm(g)],
        # g = eagle3_fc(the target layers' features) or its own previous pre-norm output.
        fuse = getattr(inner, "eagle3_fc", None)
        self.fuse = InvariantLinear(fuse.weight, None, onednn=onednn) if isinstance(fuse, torch.nn.Linear) else None
        self.hidden_norm = getattr(inner.layers[0], "hidden_norm", None) if self.fuse is not None else None
        # An EAGLE-3 head trained with norm_before_residual: layer 0's residual is hidden_norm(g), not g.
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        # An EAGLE-3 head never reads position 0 (EAGLE, vLLM, speculators feed token t + 1 with the
        # target's feature at t): the token-0 row the draft feeds holds a KV slot no later lane reads.
        self.skip_first_key = self.fuse is not None
        # Features: `feature_dim` wide as rows carry them (an EAGLE-3 head: the target's layers side
        # by side, or its own `feature_width`-wide output); `feature_width` wide inside the forward.
        self.feature_width = int(fc.out_features) if self.fc is not None else (
            int(fuse.out_features) if self.fuse is not None else 0)
        self.feature_dim = int(fuse.in_features) if self.fuse is not None else self.feature_width
        self.rotary = inner.rotary_emb
        # Gemma 3: one rotary embedding per layer type (local and global bases), called with the type.
        self.rope_types = sorted(set(config.layer_types)) if hasattr(self.rotary, "layer_types") else []
        self.norm = inner.norm
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.layers: list[_Layer] = []
        for index, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma: norms around attention and MLP
            self.layers.append(_Layer(
                attn_norm=layer.input_layernorm,
                qkv=fused([a.q_proj, a.k_proj, a.v_proj], onednn=onednn),
                o=InvariantLinear(a.o_proj.weight, a.o_proj.bias, onednn=onednn),
                mlp_norm=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
                gate_up=fused([m.gate_proj, m.up_proj], onednn=onednn),
                down=InvariantLinear(m.down_proj.weight, m.down_proj.bias, onednn=onednn),
                act=m.act_fn,
                q_width=int(a.q_proj.out_features),
                kv_width=int(a.k_proj.out_features),
                scaling=float(a.scaling),
                q_norm=getattr(a, "q_norm", None),
                k_norm=getattr(a, "k_norm", None),
                attn_out_norm=layer.post_attention_layernorm if sandwich else None,
                mlp_out_norm=layer.post_feedforward_layernorm if sandwich else None,
                window=sliding_window(model, index),
                rope=config.layer_types[index] if self.rope_types else None,
            ))
        self.head = Head(model.get_output_embeddings(), onednn=onednn,
                         softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0))
        self.gated = _gated
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self.gated = torch.compile(_gated, dynamic=True, mode=mode)
            for layer in self.layers:
                layer.attn_norm = torch.compile(layer.attn_norm, dynamic=True, mode=mode)
                layer.mlp_norm = torch.compile(layer.mlp_norm, dynamic=True, mode=mode)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def linears(self) -> list[InvariantLinear]:
        out = [self.head.linear] + [f for f in (self.fc, self.fuse) if f is not None]
        for layer in self.layers:
            out.extend((layer.qkv, layer.o, layer.gate_up, layer.down))
        return out

    def new_pool(self, budget_bytes: int) -> KVPool:
        return KVPool(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device, budget_bytes)

    def input_features(self, features: torch.Tensor) -> torch.Tensor:
        """A row's features as the forward reads them ([n, feature_width]): an EAGLE-3 head's target
        features go through its fc; its own (already feature_width wide) and others pass as they are."""
        if self.fuse is not None and features.shape[-1] != self.feature_width:
            return self.fuse(fc_input(self.model, features))
        return features

    def __call__(self, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, attention: AttentionPlan,
                 emitted: torch.Tensor) -> torch.Tensor:
        """ids, positions [T] (long, on the device); emitted [K] packed indices -> logits [K, vocab]."""
        return self.step(pool, ids, positions, attention, emitted)[0]

    def step(self, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, attention: AttentionPlan,
             emitted: torch.Tensor, features: torch.Tensor | None = None,
             hidden_index: torch.Tensor | None = None,
             hidden_layers: Sequence[int] = (FINAL,)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward: (logits [K, vocab] of `emitted`, hidden states of the tokens at `hidden_index`
        or None: [H_n, len(hidden_layers) x hidden], per entry of `hidden_layers` the residual stream
        entering that decoder layer, or for FINAL the final state (after the final norm; an EAGLE-3
        head's: before it, the feature it reads next), side by side.

        features [T, feature_width]: a feature head's input features per token (zeros if None).
        """
        h = self.embed(ids)  # [T, hidden]
        first = None  # an EAGLE-3 head's layer-0 attention input
        if self.fc is not None or self.fuse is not None:
            if features is None:
                features = h.new_zeros((h.shape[0], self.feature_width))
            features = features.to(h.dtype)
            if self.fc is not None:
                h = self.fc(torch.cat([h, features], dim=-1))
            else:
                normed = self.hidden_norm(features)
                first = torch.cat([self.layers[0].attn_norm(h), normed], dim=-1)
                h = normed if self.norm_before_residual else features
        wanted = {i for i in hidden_layers if i != FINAL} if hidden_index is not None else set()
        entering: dict[int, torch.Tensor] = {}
        rotations = {kind: self._rotation(h, positions, kind) for kind in (self.rope_types or [None])}
        t = h.shape[0]
        hd = self.head_dim
        for index, layer in enumerate(self.layers):
            if index in wanted:
                entering[index] = h.index_select(0, hidden_index)
            x = first if index == 0 and first is not None else layer.attn_norm(h)
            qkv = layer.qkv(x)  # [T, q + 2 kv]
            q = qkv[:, : layer.q_width].view(t, self.heads, hd)
            k = qkv[:, layer.q_width: layer.q_width + layer.kv_width].view(t, self.kv_heads, hd)
            v = qkv[:, layer.q_width + layer.kv_width:].view(t, self.kv_heads, hd)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            cos, sin = rotations[layer.rope]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = layer.o(attend(pool, index, attention, q, k, v.contiguous(), layer.scaling, window=layer.window,
                              skip_first=self.skip_first_key))
            h = h + (o if layer.attn_out_norm is None else layer.attn_out_norm(o))
            x = layer.mlp_norm(h)
            m = layer.down(self.gated(layer.gate_up(x), layer.act))
            h = h + (m if layer.mlp_out_norm is None else layer.mlp_out_norm(m))
        hidden = None
        if hidden_index is not None:
            last = h.index_select(0, hidden_index)
            last = last if self.fuse is not None else self.norm(last)
            blocks = [last if i == FINAL else entering[i] for i in hidden_layers]
            hidden = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
        return self.head(self.norm(h.index_select(0, emitted))), hidden

    def _rotation(self, h: torch.Tensor, positions: torch.Tensor, kind: str | None):
        """cos, sin [T, 1, hd] of the packed positions (of layer type `kind` where rotations differ by type)."""
        args = (h[None], positions[None]) if kind is None else (h[None], positions[None], kind)
        cos, sin = self.rotary(*args)  # [1, T, hd] each
        return cos[0, :, None, :], sin[0, :, None, :]

    def release_originals(self) -> None:
        """Free the loaded model's own linear weights (the engine holds its packed copies)."""
        for layer in self.model.model.layers:
            for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    setattr(parent, name, _Released(getattr(parent, name)))


class _Released(torch.nn.Module):
    """Stands where a linear was after the engine took its weights; calling it is a bug."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, *_args, **_kwargs):
        raise RuntimeError("this model's linear weights were handed to the engine's packed forward")


def _gated(gate_up: torch.Tensor, act: torch.nn.Module) -> torch.Tensor:
    """act(gate) * up of the fused gate|up product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def token_tensors(ids: Sequence[int], positions: Sequence[int], emitted: Sequence[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's index inputs as device tensors (one host->device copy each)."""
    def put(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    return put(ids), put(positions), put(emitted)

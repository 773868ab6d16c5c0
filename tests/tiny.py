"""Tiny random causal LMs with a real tokenizer, for tests and quick benchmarks.

They are saved as ordinary Hugging Face folders and loaded through the same
loader as real models. Weights are initialised with a large spread so logits
are decisive: fp32 argmax never sits on a near-tie, which keeps greedy
identity tests about specdec and not about rounding.
"""
from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A chat template that takes tools (Hermes-style <tool_call> tags, as Qwen2.5's): the tools in a
# system turn, an assistant's calls as tagged JSON, tool results as user turns.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\nTools:\n' }}{% for t in tools %}{{ t | tojson }}{{ '\n' }}"
    "{% endfor %}{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\n' }}"
    "{%- for c in m.tool_calls %}{{ '<tool_call>' }}{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}{{ '</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>' + m.content + '</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

_CORPUS = """The cat sat on the mat and the dog sat on the log.
A quick brown fox jumps over the lazy dog while the cat watches.
def add(a, b):
    return a + b
Speculative decoding drafts a few tokens and the target verifies them in one pass.
The capital of France is Paris. The capital of Italy is Rome.
Please rewrite the following sentence: the cat sat on the mat and purred.
"""


def build_tokenizer(out_dir: Path, vocab_size: int = 384, *, pad_to: int = 0):
    """Train a small byte-level BPE tokenizer and save it to `out_dir`; with `pad_to`, added tokens
    "<|vN|>" make its vocabulary that large (a real model's size: what the vocabulary costs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    if pad_to > len(fast):
        fast.add_tokens([f"<|v{i}|>" for i in range(pad_to - len(fast))])
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    out_dir: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    vocab_size: int = 384,
    init_std: float = 0.35,
    context_length: int = 512,
    perturb_from: Path | None = None,
    perturb_std: float = 0.0,
    pad_vocab_to: int = 0,
    arch: str = "llama",
    window: int = 8,
) -> Path:
    """Save a tiny Llama-architecture model (and its tokenizer) to `out_dir`.

    `arch` "qwen3" (q/k norms; its layers after the first sliding-window layers of `window` keys)
    or "gemma3" (sandwich norms, q/k norms, alternating sliding and global layers with their own
    rotary bases, scaled embeddings) builds that family instead, same sizes.

    With `perturb_from`, start from that model's weights and add Gaussian noise
    of `perturb_std` (relative to each tensor's std): a draft that agrees with
    its target often but not always. `pad_vocab_to`: the tokenizer's (and so the model's) vocabulary
    padded to that many ids (build_tokenizer).
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, vocab_size, pad_to=pad_vocab_to)
    gen = torch.Generator().manual_seed(seed)
    if perturb_from is not None:
        model = AutoModelForCausalLM.from_pretrained(perturb_from, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * perturb_std * p.std())
    else:
        config = _family_config(arch, window, layers, dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context_length,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    continue
                p.copy_(torch.randn(p.shape, generator=gen) * init_std / (p.shape[-1] ** 0.5) * 8)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def _family_config(arch: str, window: int, layers: int, common: dict):
    """The config of a tiny model of family `arch` (build_model)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**common)
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, use_sliding_window=True, sliding_window=window,
                           max_window_layers=1)
    if arch == "gemma3":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=window, layer_types=kinds,
                                query_pre_attn_scalar=head_dim, hidden_activation="gelu_pytorch_tanh")
    raise ValueError(f"unknown tiny family {arch!r}")


def distill_target(root: Path):
    """The tiny target the distill tests train against (4 layers, one torch thread), loaded, and the
    40 training and 8 held-out prompts they answer: (target folder, loaded target, train, held-out)."""
    from distill import prompts
    from engine.model.loader import load

    torch.set_num_threads(1)
    target_dir = build_model(root / "target", seed=3, layers=4, init_std=0.08)
    train_prompts, heldout_prompts = prompts.split(prompts.load(), 40, 8)
    return target_dir, load(str(target_dir)), train_prompts, heldout_prompts


def build_pair(root: Path, *, draft_noise: float = 0.04, vocab: int = 0) -> tuple[Path, Path]:
    """A tiny target and a tiny draft derived from it by noise; returns (target, draft). `vocab`:
    both vocabularies padded to that many ids (0: the trained 384)."""
    root = Path(root)
    target = build_model(root / "target", seed=0, pad_vocab_to=vocab)
    draft = build_model(root / "draft", seed=1, perturb_from=target, perturb_std=draft_noise, pad_vocab_to=vocab)
    return target, draft


def build_feature_head(target: Path, out_dir: Path, *, feature_weight: float = 0.02, noise: float = 0.0,
                       seed: int = 0) -> Path:
    """A tiny EAGLE-style feature head of `target` (engine.model.drafts kind "eagle"), saved as a draft folder.

    A random tiny target cannot be learned in seconds, so the head is made, not
    trained: all of the target's layers (build_feature_head keeps the last
    `num_layers`), fc = [I | feature_weight * R] (its own embedding, plus a random
    view of the target feature it reads), and Gaussian noise of `noise` (relative
    to each tensor's std) on every trained tensor. It agrees with the target
    often but not always, and its drafts depend on the features it is sent.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model import drafts
    from specdec.core.fingerprint import tokenizer_fingerprint

    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    head = drafts.build_feature_head(model, layers, None)
    hidden = head.config.hidden_size
    with torch.no_grad():
        fc = head.model.fc
        fc.weight[:, :hidden] = torch.eye(hidden)
        fc.weight[:, hidden:] = torch.randn(hidden, hidden, generator=gen) * feature_weight / hidden ** 0.5
        for _, p in drafts.trainable_named(head):
            p.add_(torch.randn(p.shape, generator=gen) * noise * (p.std() if p.numel() > 1 else 1.0))
    tokenizer = AutoTokenizer.from_pretrained(target)
    manifest = drafts.Manifest(
        target=str(Path(target).resolve()), target_name=Path(target).name,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), num_layers=layers, vocab_subset=0,
        dtype="float32", kind=drafts.EAGLE, recipe={"method": "tests.tiny: the target's layers + noise"})
    head.requires_grad_(False)
    return drafts.save(head, out_dir, manifest)


def build_eagle3_head(target: Path, out_dir: Path, *, layers: tuple[int, ...] = (0, 1), draft_vocab: int = 160,
                      with_embedding: bool = False, seed: int = 0) -> Path:
    """A tiny EAGLE-3 head for `target` in the published layout (EAGLE's and SpecForge's checkpoints,
    as vLLM and SGLang load them), written from scratch here, not through specdec's code.

    config.json: a Llama config with draft_vocab_size and
    eagle_aux_hidden_state_layer_ids (and the nested SpecForge form); model.safetensors: fc.weight
    [H, n H], midlayer.* (q/k/v reading 2H, hidden_norm), norm.weight,
    lm_head.weight [draft_vocab, H], d2t (draft id i -> target id i + d2t[i]) and
    t2d. The draft vocabulary is every other token id from 0 up (so d2t is not
    zero), and the weights are random: the head drafts, rarely well.
    """
    import json

    from safetensors.torch import save_file

    target_config = json.loads((Path(target) / "config.json").read_text())
    hidden, vocab = int(target_config["hidden_size"]), int(target_config["vocab_size"])
    heads, kv_heads = int(target_config["num_attention_heads"]), int(target_config["num_key_value_heads"])
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 2.0 / shape[-1] ** 0.5

    ids = torch.arange(draft_vocab) * 2 % vocab
    tensors = {
        "fc.weight": rand(hidden, len(layers) * hidden),
        "midlayer.input_layernorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        "midlayer.hidden_norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(2 * hidden, hidden),
        "midlayer.mlp.up_proj.weight": rand(2 * hidden, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, 2 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden) * 4.0,
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(target_config.get("rope_theta", 10000.0)),
        "max_position_embeddings": 2048, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        # Both conventions, naming the same layers: the top level as entered (EAGLE, vLLM), the
        # nested one as outputs (SpecForge, SGLang), where it can name them.
        "eagle_aux_hidden_state_layer_ids": list(layers),
        **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
                             "use_aux_hidden_state": True}} if all(i >= 1 for i in layers) else {}),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def build_permuted_draft(target: Path, out_dir: Path, *, seed: int = 5, noise: float = 0.04) -> Path:
    """A draft with another tokenizer that reads text as the target does: the target's tokenizer
    with its non-special ids shuffled (the same pieces and merges, other ids: another
    fingerprint), and the target's weights with the embedding rows moved to match, plus noise.
    In the target's ids it is a good draft; its own ids share nothing with the target's."""
    import json

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    original = AutoTokenizer.from_pretrained(target)
    spec = json.loads(original.backend_tokenizer.to_str())
    specials = {t["id"] for t in spec["added_tokens"]}
    vocab = spec["model"]["vocab"]
    movable = sorted(i for i in vocab.values() if i not in specials)
    shuffled = torch.randperm(len(movable), generator=torch.Generator().manual_seed(seed)).tolist()
    new_id = {old: movable[j] for old, j in zip(movable, shuffled)} | {i: i for i in specials}
    spec["model"]["vocab"] = {piece: new_id[i] for piece, i in vocab.items()}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token=original.bos_token,
        eos_token=original.eos_token, unk_token=original.unk_token, pad_token=original.pad_token)
    fast.chat_template = original.chat_template
    fast.save_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        order = torch.arange(embedding.shape[0])  # row new_id[i] of the draft = row i of the target
        for old, new in new_id.items():
            order[new] = old
        embedding.copy_(embedding[order])
        if not model.config.tie_word_embeddings:
            head = model.get_output_embeddings().weight
            head.copy_(head[order])
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    model.save_pretrained(out_dir)
    return out_dir

"""Run in a subprocess with vLLM's `speculators` importable (`make speculators` overlays it):
write a tiny EAGLE-3 head with `speculators`' own Eagle3DraftModel and compute its logits with its
own forward, the reference tests/unit/test_speculators_heads.py holds specdec to.

  python tests/speculators_reference.py TARGET_FOLDER OUT_FOLDER [--layer-type llama|qwen3]
      [--norm-before-residual] [--norm-before-fc | --fc-norm] [--aux 0,1] [--draft-vocab 160]
  python tests/speculators_reference.py TARGET_FOLDER OUT_FOLDER --convert EAGLE_HEAD [--aux 0,1]
      (speculators' own converter, Eagle3Converter, on a head in EAGLE's layout: no reference.pt)

OUT_FOLDER: the head as `save_pretrained` writes it, and reference.pt: {"input_ids" [n], "features"
[n, len(aux) * H], "logits" [n, draft_vocab], "d2t"}: speculators' forward (one step of its
test-time training loop, so the head reads the given features at every position) on input_ids
x_1..x_n with features g_0..g_{n-1}, as its training pairs them (speculators.models.eagle3.data).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OVERLAY = [REPO / ".venv" / "speculators", REPO / ".venv" / "guidellm"]  # make speculators


def written(target: Path, out: Path, *flags: str) -> Path:
    """Run this script for `target` (a pytest test calls it): the head in `out`, with reference.pt.
    Skips where `make speculators` has not run, fails so under CI."""
    import pytest

    if not (OVERLAY[0] / ".installed").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"speculators is not installed in {OVERLAY[0]} (make test runs `make speculators`)")
        pytest.skip("speculators is not installed: run `make speculators`")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in OVERLAY), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, str(target), str(out), *flags], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--layer-type", default="llama", choices=("llama", "qwen3"))
    p.add_argument("--norm-before-residual", action="store_true")
    p.add_argument("--norm-before-fc", action="store_true")
    p.add_argument("--fc-norm", action="store_true")
    p.add_argument("--aux", default="0,1")
    p.add_argument("--draft-vocab", type=int, default=160)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--convert", type=Path, help="convert this EAGLE-layout head instead")
    args = p.parse_args()
    if args.convert:
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter

        Eagle3Converter().convert(args.convert, args.out, base_model=str(args.target), validate=False,
                                  eagle_aux_hidden_state_layer_ids=[int(i) for i in args.aux.split(",")])
        print(json.dumps({"files": sorted(f.name for f in args.out.iterdir())}))
        return

    from transformers import AutoConfig, LlamaConfig, Qwen3Config

    from speculators.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(0)
    target = AutoConfig.from_pretrained(args.target)
    common = dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                  intermediate_size=target.intermediate_size, num_attention_heads=target.num_attention_heads,
                  num_key_value_heads=target.num_key_value_heads, num_hidden_layers=1,
                  max_position_embeddings=target.max_position_embeddings, rms_norm_eps=target.rms_norm_eps,
                  head_dim=target.hidden_size // target.num_attention_heads)
    layer_config = (LlamaConfig if args.layer_type == "llama" else Qwen3Config)(**common)
    aux = [int(i) for i in args.aux.split(",")]
    vocab, draft_vocab = target.vocab_size, args.draft_vocab
    ids = torch.arange(draft_vocab) * 2 % vocab
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    model = Eagle3DraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=ids - torch.arange(draft_vocab), num_layers=1,
        norm_before_residual=args.norm_before_residual, norm_before_fc=args.norm_before_fc, fc_norm=args.fc_norm,
        draft_vocab_size=draft_vocab, ttt_steps=1,
        verifier_name_or_path=str(args.target), target_layer_ids=aux, draft_attn_impl="sdpa")
    with torch.no_grad():  # decisive logits: a tiny random head's are near-ties otherwise
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif param.dim() == 2 and "embed" not in name:
                param.normal_(0.0, 2.0 / param.shape[-1] ** 0.5)
    model.eval()
    model.save_pretrained(args.out)

    n, hidden = args.tokens, target.hidden_size
    input_ids = torch.randint(0, vocab, (n,))
    features = torch.randn(n, len(aux) * hidden)
    captured: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    with torch.no_grad():
        model(hidden_states=features[None], input_ids=input_ids[None],
              document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=1)
    torch.save({"input_ids": input_ids, "features": features, "logits": captured[0][0],
                "d2t": model.d2t.clone()}, args.out / "reference.pt")
    print(json.dumps({"config": json.loads((args.out / "config.json").read_text()),
                      "files": sorted(f.name for f in args.out.iterdir())}))


if __name__ == "__main__":
    main()

"""What the distill stages share: the target as each stage loads it, and the held-out data.

(Its own module so that distill.cli and the stage modules it dispatches to,
such as distill.eagle, both import it without importing each other.)
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("distill")


def fast_dtype(value: str, device: torch.device | str) -> str:
    """`value`, or for "auto" bfloat16 where the device computes it natively, else float32 (on a CPU
    without bfloat16 instructions a bfloat16 forward is several times slower than a float32 one)."""
    if value != "auto":
        return value
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"  # fp16 would need loss scaling
    return "bfloat16" if cpu_computes_bfloat16() else "float32"


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX-512 BF16 or AMX). oneDNN's own check also says yes
    where it only emulates them, and there a bfloat16 forward measured about 4x slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: oneDNN's answer
        mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return mkldnn_bf16 is not None and bool(mkldnn_bf16())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _amp(args: argparse.Namespace, device: torch.device) -> str:
    return fast_dtype(args.amp, device)


def _target_loader_spec(target: str) -> str | None:
    return None if target in ("", "default") else target


def load_target(args: argparse.Namespace, dtype: str) -> Any:
    from engine.model import loader

    return loader.load(_target_loader_spec(args.target_model), device=args.device,
                       dtype=fast_dtype(dtype, args.device))


def pad_id(target: Any) -> int:
    """The id that pads a loaded target's batches: its tokenizer's pad token, else its first EOS."""
    pad = target.tokenizer.pad_token_id
    return pad if pad is not None else target.eos_token_ids[0]


def generate_set(args: argparse.Namespace, name: str, subset: list, dtype: str,
                 deadline: float | None = None) -> dict[str, Any]:
    """Target responses for one prompt subset under OUT/data/NAME (resumable); its summary."""
    from distill import data

    dtype = fast_dtype(dtype, args.device)
    target = load_target(args, dtype)
    # A feature head's training data keeps the features generation computes anyway (no second target pass).
    config = data.GenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, top_k=args.top_k,
                            shard_prompts=args.shard_prompts,
                            features=head_inputs(args, target.model.config) if name == "train" else (),
                            sampled=getattr(args, "sampled", 0.0) if name == "train" else 0.0)
    started = time.monotonic()
    data.generate(target.model, target.tokenizer, subset, args.out / "data" / name, target.eos_token_ids,
                  config, desc=f"{name} data ({dtype})", deadline=deadline)
    records = data.load_records(args.out / "data" / name)
    summary = {"prompts": len(records), "tokens": sum(len(r["response"]) for r in records),
               "dtype": dtype, "seconds_this_run": round(time.monotonic() - started, 1),
               "tokenizer_fingerprint": target.tokenizer_fingerprint, "target_name": target.name}
    log.info("%s data: %d prompts, %d response tokens", name, summary["prompts"], summary["tokens"])
    return summary


def head_inputs(args: argparse.Namespace, config: Any) -> tuple[int, ...]:
    """The target hidden states a feature head of --kind reads (distill.data.GenConfig.features): the final
    state for eagle, the streams entering --aux-layers (EAGLE-3's 2, L // 2, L - 3 by default) for eagle3."""
    if args.kind == "eagle":
        return (-1,)
    if args.kind != "eagle3":
        return ()
    from engine.model.eagle3 import aux_layers

    given = {"eagle_aux_hidden_state_layer_ids": args.aux_layers} if getattr(args, "aux_layers", None) else {}
    return aux_layers(given, int(config.num_hidden_layers))


def heldout_v2_prompts(args: argparse.Namespace) -> list:
    """The separately built held-out set of --heldout-file (empty when disabled)."""
    from distill import heldout

    return heldout.load_v2(Path(args.heldout_file)) if args.heldout_file else []


def heldout_records(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Held-out records per set: the templated one, and the separate one (generated here if missing)."""
    from distill import data

    sets = {"heldout": data.load_records(args.out / "data" / "heldout")}
    if args.heldout_file:
        v2_prompts = heldout_v2_prompts(args)
        if len(data.load_records(args.out / "data" / "heldout_v2")) < len(v2_prompts):
            generate_set(args, "heldout_v2", v2_prompts, "float32")
        sets["heldout_v2"] = data.load_records(args.out / "data" / "heldout_v2")
    return sets

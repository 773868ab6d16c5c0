"""Train and evaluate an EAGLE-3 head, written in the published layout (engine.model.eagle3).

The head reads, with each token, the residual streams entering three of the
target's layers (--aux-layers; EAGLE-3's 2, L // 2, L - 3 by default) at the
position before, fused by fc, and past the target's features its own pre-norm
output. It predicts tokens directly: no feature regression.

Data: the data stage keeps those streams for every position the target read
while generating (distill.data, GenConfig.features), so training runs no
target pass; held-out sets get theirs teacher-forced in float32, as served.
Labels are the target's stored top-k log-probabilities (a sampled response's
too: the distribution, not the sampled token, is the label).

Init, so that a few CPU-minutes of training start from something that works:
the decoder layer is the target's last (its q/k/v read [token; feature], each
half the target's projection / sqrt 2), fc passes the highest aux layer's stream
through (the other two start at zero), the final norm is the target's and the
head rows are the target's tied embedding rows of the draft vocabulary (which
train, as EAGLE-3's own head does). The draft vocabulary is the most frequent
tokens of the training responses and prompts.

Loss (distill.eagle._losses_eagle3): per unrolled pass (training-time test,
distill.eagle.multi_pass) KL to the target's top-k + --hard-weight x
cross-entropy to its greedy token. Evaluation simulates greedy chains exactly
(distill.eagle.quality) on both held-out sets.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def choose_vocab(records: list[dict[str, Any]], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The draft vocabulary: the `size` most frequent tokens of the training responses and their prompts
    (responses weigh double: they are what is drafted), then the target's top-k alternatives; sorted ids."""
    return torch.sort(_order(records, vocab, always)[:size]).values


def _order(records: list[dict[str, Any]], vocab: int, always: list[int]) -> torch.Tensor:
    from distill.train import vocab_order

    return vocab_order(records, vocab, always, response_weight=2, prompt_weight=1)


def coverage_curve(records: list[dict[str, Any]], sets: dict[str, list[dict[str, Any]]], vocab: int,
                   always: list[int], sizes: tuple[int, ...] = (8192, 12288, 16384, 24576, 32768)
                   ) -> dict[int, dict[str, float]]:
    """Coverage of each held-out set's response tokens by the draft vocabulary chosen at each size."""
    order = _order(records, vocab, always)  # ranked once; each size takes its prefix
    tokens = {name: torch.tensor([t for r in rs for t in r["response"]]) for name, rs in sets.items()}
    out = {}
    for size in sizes:
        if size >= vocab:
            continue
        member = torch.zeros(vocab, dtype=torch.bool)
        member[order[:size]] = True
        out[size] = {name: round(float(member[ids].float().mean()), 4) for name, ids in tokens.items()}
    return out


@torch.no_grad()
def new_head(target: Any, layers: tuple[int, ...], draft_ids: torch.Tensor) -> Any:
    """An EAGLE-3 head for loaded target `target` (engine.model.loader's LoadedModel), initialised from it (see
    the module doc); float32, its embedding frozen, everything else trainable."""
    from engine.model import eagle3
    from engine.model.drafts import trainable_parameters

    model = target.model
    config = model.config
    raw = {**eagle3.head_config(config), **eagle3.aux_layer_fields(layers)}
    embed = model.get_input_embeddings().weight.detach().float()
    head, layers = eagle3.build(raw, config, draft_ids, embed, torch.float32)
    last = model.model.layers[-1]
    mid = head.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(last.self_attn, name).weight.float() / math.sqrt(2)
        getattr(mid.self_attn, name).weight.copy_(torch.cat([w, w], dim=1))
    for src, dst in ((last.self_attn.o_proj, mid.self_attn.o_proj), (last.mlp.gate_proj, mid.mlp.gate_proj),
                     (last.mlp.up_proj, mid.mlp.up_proj), (last.mlp.down_proj, mid.mlp.down_proj),
                     (last.input_layernorm, mid.input_layernorm), (last.input_layernorm, mid.hidden_norm),
                     (last.post_attention_layernorm, mid.post_attention_layernorm), (model.model.norm, head.model.norm)):
        dst.weight.copy_(src.weight.float())
    hidden = int(config.hidden_size)
    fc = head.model.eagle3_fc.weight
    fc.zero_()
    fc[:, -hidden:] = torch.eye(hidden)
    lm = head.lm_head
    rows = lm.sub_weight.clone()
    del lm._buffers["sub_weight"]
    lm.sub_weight = torch.nn.Parameter(rows)  # the head's rows train (a buffer again once saved and loaded)
    head.requires_grad_(False)
    for p in trainable_parameters(head):
        p.requires_grad_(True)
    return head.to(next(model.parameters()).device)


VOCAB_FILE = "eagle3-vocab.pt"  # the draft vocabulary a checkpoint's head rows belong to


def resumed_vocab(train_dir: Path, size: int) -> torch.Tensor | None:
    """The draft vocabulary of a run being resumed (its checkpoint's head rows are these tokens', whatever
    the data now holds), or None for a fresh run."""
    ids, ckpt = train_dir / VOCAB_FILE, train_dir / "eagle3-checkpoint.pt"
    if not (ids.is_file() and ckpt.is_file()):
        return None
    kept = torch.load(ids, weights_only=True)
    if kept.numel() != size:
        raise SystemExit(f"{ckpt} was trained with a {kept.numel()}-token draft vocabulary, not --vocab {size}: "
                         "give that size, or remove the checkpoint to start over")
    log.info("resuming with the checkpoint's %d-token draft vocabulary", size)
    return kept


def run_train(args: Any) -> dict[str, Any]:
    """`python -m distill train --kind eagle3`: the head -> OUT/draft (published layout)."""
    from distill import data, eagle, sources

    started = time.monotonic()
    train_dir = Path(args.out) / "data" / "train"
    info = json.loads((Path(args.out) / "data" / "info.json").read_text())
    target = sources.load_target(args, "float32")
    layers = sources.head_inputs(args, target.model.config)
    pad = sources.pad_id(target)
    records, features, feature_summary = eagle.cached_features(
        target.model, train_dir, eagle.feature_cache(args, "train"), dtype=sources.fast_dtype(args.feature_dtype,
                                                                                               args.device),
        pad_id=pad, layers=layers)
    if not records:
        raise SystemExit(f"no training data under {train_dir}: run the data stage first")
    vocab = target.vocab_size
    size = args.vocab if 0 < args.vocab < vocab else vocab
    draft_ids = resumed_vocab(Path(args.out) / "train", size)
    if draft_ids is None:
        draft_ids = choose_vocab(records, size, vocab, list(target.eos_token_ids))
    sets = {name: data.load_records(Path(args.out) / "data" / name) for name in ("heldout", "heldout_v2")}
    curve = coverage_curve(records, {k: v for k, v in sets.items() if v}, vocab, list(target.eos_token_ids))
    log.info("draft vocabulary coverage of the held-out responses by size: %s", curve)
    head = new_head(target, layers, draft_ids)
    (Path(args.out) / "train").mkdir(parents=True, exist_ok=True)
    torch.save(draft_ids, Path(args.out) / "train" / VOCAB_FILE)
    config = eagle.EagleConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                               amp=sources._amp(args, target.device), depth=args.depth, feature_weight=0.0,
                               hard_weight=args.hard_weight, seed=args.seed)
    budget = max(60.0, 60 * args.train_minutes - (time.monotonic() - started)) if args.train_minutes > 0 else None
    log.info("training an EAGLE-3 head (target layers %s, %d-token draft vocabulary, %d trainable parameters, "
             "depth %d) on %d sequences / %d response tokens, amp %s, budget %s s", list(layers), size,
             sum(p.numel() for p in head.parameters() if p.requires_grad), config.depth, len(records),
             sum(len(r["response"]) for r in records), config.amp, None if budget is None else round(budget))
    summary = eagle.train(head, records, features, config, Path(args.out) / "train" / "eagle3-checkpoint.pt",
                          pad_id=pad, vocab=vocab, budget_s=budget)
    config = eagle.EagleConfig(**summary["config"])
    recipe = {
        "method": f"EAGLE-3 head: KL to the target's top-{info.get('top_k', 20)} + {config.hard_weight} x "
                  f"cross-entropy to its greedy token, {config.depth} unrolled passes on its own outputs "
                  "(training-time test), no feature regression",
        "init": "the target's last decoder layer (q/k/v over [token; feature], halves / sqrt 2), fc passing the "
                "highest aux layer through, the target's final norm and tied-embedding rows",
        "data": {k: info[k] for k in ("train", "heldout", "heldout_v2", "max_new_tokens", "top_k", "sampled")
                 if k in info},
        "features": feature_summary,
        "vocab_coverage_by_size": {str(k): v for k, v in curve.items()},
        "train": {**asdict(config), "epochs": summary["epochs"], "seconds": summary["seconds"],
                  "stage_seconds": round(time.monotonic() - started, 1),
                  "final": summary["history"][-1] if summary["history"] else {}},
        "hardware": f"{args.device}, {torch.get_num_threads()} threads",
    }
    from engine.model import eagle3

    folder = eagle3.save(head, layers, Path(args.out) / "draft", torch.bfloat16 if args.draft_dtype == "bfloat16"
                         else torch.float32, extra={"specdec_recipe": recipe, "specdec_target": target.name})
    log.info("EAGLE-3 head written to %s", folder)
    return summary


def run_eval(args: Any) -> dict[str, Any]:
    """`python -m distill eval --kind eagle3`: both held-out sets, per-depth acceptance, tokens/pass."""
    from distill import eagle, evaluate, sources
    from engine.model import loader
    from engine.model.drafts import subset_of

    sets = sources.heldout_records(args)
    folder = args.draft_model or Path(args.out) / "draft"
    trained = loader.load(str(folder), device=args.device, dtype=args.draft_dtype,
                          base=sources._target_loader_spec(args.target_model))
    if not trained.feature_kind.startswith("layers:"):
        raise SystemExit(f"{folder} is not an EAGLE-3 head")
    layers = tuple(int(i) for i in trained.feature_kind.removeprefix("layers:").split(","))
    target = sources.load_target(args, "float32")
    pad = sources.pad_id(target)
    subset = subset_of(trained.model)
    result: dict[str, Any] = {"draft_folder": str(folder), "kind": "eagle3", "layers": list(layers),
                              "dtype": args.draft_dtype, "by_set": {}}
    for name in sets:
        records, feats, _ = eagle.cached_features(target.model, Path(args.out) / "data" / name,
                                                  eagle.feature_cache(args, name), dtype="float32", pad_id=pad,
                                                  layers=layers)
        started = time.monotonic()
        q = eagle.quality(trained.model, records, feats)
        q["vocab_coverage"] = round(evaluate.coverage(records, subset), 4)
        q["seconds"] = round(time.monotonic() - started, 1)
        result["by_set"][name] = q
        log.info("%s: agreement %.1f%%, coverage %.1f%%, depth acceptance %s, tokens/pass %s", name,
                 100 * q["agreement"], 100 * q["vocab_coverage"], q["depth_acceptance"], q["tokens_per_pass"])
    result["threads"] = torch.get_num_threads()
    out = Path(args.out) / ("eval.json" if args.draft_model is None else f"eval-{Path(folder).name}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result

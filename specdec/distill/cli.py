"""python -m specdec.distill [data|train|eval|all] --target ... --out DIR

Stages (each resumable, each reads what the previous one wrote under --out):
  data   target greedy responses + top-k log-probs for the training prompts
         (in --gen-dtype) and the held-out prompts (in float32, the dtype the
         target is served in, so held-out labels are its true greedy tokens)
         -> OUT/data/{train,heldout}/shard-*.pt
  train  draft = target embedding + first --layers layers + final norm + tied
         head (optionally --vocab rows), trained on the soft labels
         -> OUT/train/checkpoint.pt, then the draft folder OUT/draft/
  eval   held-out agreement and tokens/pass of OUT/draft (loaded through
         specdec.hosting.loader, as the draft service loads it) and of the
         early-exit stand-in; cost ratio c and v(k) -> OUT/eval.json
Serve the result with `python -m draft_service --model OUT/draft`.
The defaults (every shipped prompt, 34 + 17 minute budgets for data and
training) finish in about an hour on a 2-core CPU; on a GPU, the budgets do
not bind: raise --prompts (with a larger --prompt-file), --max-new-tokens and --steps.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("specdec.distill")
STAGES = ("data", "train", "eval", "all")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdec distill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("stage", nargs="?", default="all", choices=STAGES)
    p.add_argument("--target", default="default",
                   help="target: 'default' (the embedded SmolLM2-135M-Instruct), a HF folder or a .gguf file")
    p.add_argument("--out", required=True, type=Path, help="working folder (data, checkpoints, draft, eval)")
    p.add_argument("--prompts", type=int, default=0, help="training prompts; 0 = all of the prompt file's (default)")
    p.add_argument("--prompt-file", type=Path, default=None, help="JSONL of {messages: [...]} (default: shipped set)")
    p.add_argument("--heldout", type=int, default=64, help="held-out prompts (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="response length cap (default %(default)s)")
    p.add_argument("--gen-batch", type=int, default=128, help="prompts per generation batch (default %(default)s)")
    p.add_argument("--shard-prompts", type=int, default=128,
                   help="prompts per data shard, the unit of resumption (default %(default)s)")
    p.add_argument("--gen-dtype", default="bfloat16",
                   help="target dtype for training data (default %(default)s; held-out data is always float32)")
    p.add_argument("--top-k", type=int, default=20, help="target log-probs stored per position (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers (default %(default)s)")
    p.add_argument("--vocab", type=int, default=8192,
                   help="reduced head: the N most frequent tokens; 0 = full vocabulary (default %(default)s)")
    p.add_argument("--steps", type=int, default=3000, help="optimiser steps (default %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=2048, help="response positions per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default %(default)s)")
    p.add_argument("--amp", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="training autocast dtype; auto = bfloat16 where supported (default %(default)s)")
    p.add_argument("--draft-dtype", default="bfloat16",
                   help="dtype of the stored draft tensors and of evaluation (default %(default)s)")
    p.add_argument("--data-minutes", type=float, default=34,
                   help="time budget of the data stage: no new shard after it; a rerun resumes "
                        "(0 = none; default %(default)s)")
    p.add_argument("--train-minutes", type=float, default=17,
                   help="time budget of training: fewer steps if --steps would not fit "
                        "(0 = none; default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0, ... (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p


def _amp(args: argparse.Namespace, device: torch.device) -> str:
    if args.amp != "auto":
        return args.amp
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"  # fp16 would need loss scaling
    mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return "bfloat16" if mkldnn_bf16 is not None and mkldnn_bf16() else "float32"


def _target_loader_spec(target: str) -> str | None:
    return None if target in ("", "default") else target


def load_target(args: argparse.Namespace, dtype: str) -> Any:
    from specdec.hosting import loader

    return loader.load(_target_loader_spec(args.target), device=args.device, dtype=dtype)


def stage_data(args: argparse.Namespace) -> dict[str, Any]:
    from specdec.distill import data, prompts

    prompt_set = prompts.load(args.prompt_file) if args.prompt_file else prompts.load()
    train_prompts, heldout_prompts = prompts.split(prompt_set, args.prompts or None, args.heldout)
    info_path = args.out / "data" / "info.json"
    config = data.GenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, top_k=args.top_k,
                            shard_prompts=args.shard_prompts)
    summary: dict[str, Any] = {"target": args.target, "max_new_tokens": args.max_new_tokens, "top_k": args.top_k}
    deadline = time.monotonic() + 60 * args.data_minutes if args.data_minutes > 0 else None
    for name, subset, dtype in (("heldout", heldout_prompts, "float32"), ("train", train_prompts, args.gen_dtype)):
        target = load_target(args, dtype)
        started = time.monotonic()
        data.generate(target.model, target.tokenizer, subset, args.out / "data" / name, target.eos_token_ids,
                      config, desc=f"{name} data ({dtype})", deadline=deadline if name == "train" else None)
        records = data.load_records(args.out / "data" / name)
        summary[name] = {"prompts": len(records), "tokens": sum(len(r["response"]) for r in records),
                         "dtype": dtype, "seconds_this_run": round(time.monotonic() - started, 1)}
        summary["tokenizer_fingerprint"] = target.tokenizer_fingerprint
        summary["target_name"] = target.name
        log.info("%s data: %d prompts, %d response tokens", name, summary[name]["prompts"], summary[name]["tokens"])
        del target
    info_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def stage_train(args: argparse.Namespace) -> dict[str, Any]:
    from specdec.distill import data, train
    from specdec.hosting import drafts

    records = data.load_records(args.out / "data" / "train")
    if not records:
        raise SystemExit(f"no training data under {args.out / 'data' / 'train'}: run the data stage first")
    info = json.loads((args.out / "data" / "info.json").read_text())
    target = load_target(args, "float32")
    model = target.model
    vocab = target.vocab_size
    subset = None
    if 0 < args.vocab < vocab:
        subset = train.choose_subset(records, args.vocab, vocab, always=target.eos_token_ids)
    drafts.build_from_target(model, args.layers, subset)
    config = train.TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                               amp=_amp(args, target.device), seed=args.seed)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_token_ids[0]
    log.info("training a %d-layer draft (%s head, %d trainable parameters) on %d sequences / %d tokens, amp %s",
             args.layers, f"{subset.numel()}-row" if subset is not None else "full", 
             sum(p.numel() for p in drafts.trainable_parameters(model)), len(records),
             sum(len(r["response"]) for r in records), config.amp)
    summary = train.train(model, records, config, args.out / "train" / "checkpoint.pt", pad_id=pad, vocab=vocab,
                          budget_s=60 * args.train_minutes if args.train_minutes > 0 else None)
    config = train.TrainConfig(**summary["config"])
    manifest = drafts.Manifest(
        target=drafts.target_spec(_target_loader_spec(args.target)),
        target_name=target.name,
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        num_layers=args.layers,
        vocab_subset=int(subset.numel()) if subset is not None else 0,
        dtype=args.draft_dtype,
        recipe={
            "method": "self-distillation: soft cross-entropy to the target's top-k log-probs",
            "init": f"target embedding + layers 0..{args.layers - 1} + final norm + tied head (frozen embedding/head)",
            "data": {k: info[k] for k in ("train", "heldout", "max_new_tokens", "top_k") if k in info},
            "prompts": "specdec/data/distill_prompts.jsonl" if args.prompt_file is None else str(args.prompt_file),
            "train": {**{k: v for k, v in config.__dict__.items()}, "epochs": summary["epochs"],
                      "seconds": summary["seconds"], "final": summary["history"][-1] if summary["history"] else {}},
        },
    )
    out = drafts.save(model, args.out / "draft", manifest)
    log.info("draft written to %s", out)
    return summary


def cost_variants(args: argparse.Namespace, target_model: Any, context: list[int],
                  subset: torch.Tensor | None) -> dict[str, Any]:
    """What the reduced head and the dtype buy: the draft's c with and without each.

    Timed on untrained drafts of the same shape (cost does not depend on the weights).
    """
    from specdec.distill import evaluate
    from specdec.hosting import drafts

    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        for head in ("full", "subset") if subset is not None else ("full",):
            model = load_target(args, dtype).model
            drafts.build_from_target(model, args.layers, subset if head == "subset" else None)
            model.eval()
            cost = evaluate.cost(model, target_model, context, repeats=20, ks=())
            out[f"{dtype}/{head}"] = {"draft_ms": cost["draft_ms"], "target_ms": cost["target_ms"], "c": cost["c"]}
            log.info("cost %s/%s head: %.2f ms vs target %.2f ms (c = %.3f)", dtype, head, cost["draft_ms"],
                     cost["target_ms"], cost["c"])
    return out


def stage_eval(args: argparse.Namespace) -> dict[str, Any]:
    from specdec.distill import data, evaluate
    from specdec.hosting import drafts
    from specdec.hosting import loader

    records = data.load_records(args.out / "data" / "heldout")
    train_records = data.load_records(args.out / "data" / "train")
    folder = args.out / "draft"
    trained = loader.load(str(folder), device=args.device, dtype=args.draft_dtype)
    target = load_target(args, "float32")
    stand_in = loader.load(_target_loader_spec(args.target), device=args.device, dtype="float32",
                           num_layers=args.layers)
    context = (records[0]["prompt"] + records[0]["response"])[:256]
    result: dict[str, Any] = {"heldout_prompts": len(records)}
    subset = drafts.subset_of(trained.model)
    result["vocab_coverage"] = {"heldout": round(evaluate.coverage(records, subset), 4),
                                "train": round(evaluate.coverage(train_records, subset), 4)}
    for name, model in (("draft", trained.model), ("stand_in", stand_in.model)):
        log.info("evaluating %s on %d held-out responses", name, len(records))
        quality = evaluate.quality(model, records)
        cost = evaluate.cost(model, target.model, context)
        result[name] = {**quality, "cost": cost,
                        **evaluate.speedups(quality["tokens_per_pass"], cost["c"], cost["v"], quality["agreement"])}
    result["draft"]["dtype"] = args.draft_dtype
    result["cost_variants"] = cost_variants(args, target.model, context, subset)
    result["threads"] = torch.get_num_threads()
    (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    manifest = drafts.Manifest.read(folder)
    summary = {k: result["draft"][k] for k in ("agreement", "tokens_per_pass", "best_k", "speedup", "cost")}
    summary |= {"stand_in_agreement": result["stand_in"]["agreement"], "vocab_coverage": result["vocab_coverage"],
                "heldout_positions": result["draft"]["positions"]}
    drafts.Manifest(**{**manifest.__dict__, "eval": summary}).write(folder)
    d = result["draft"]
    log.info("held-out agreement %.1f%% (stand-in %.1f%%); tokens/pass %s; c = %.3f (%.2f ms vs %.2f ms)",
             100 * d["agreement"], 100 * result["stand_in"]["agreement"], d["tokens_per_pass"],
             d["cost"]["c"], d["cost"]["draft_ms"], d["cost"]["target_ms"])
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "distill.log")],
    )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.layers < 1:
        raise SystemExit("--layers must be >= 1")
    stages = ("data", "train", "eval") if args.stage == "all" else (args.stage,)
    for stage in stages:
        started = time.monotonic()
        log.info("stage %s: starting", stage)
        {"data": stage_data, "train": stage_train, "eval": stage_eval}[stage](args)
        log.info("stage %s: done in %.1f s", stage, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

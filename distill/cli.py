"""python -m distill [data|train|eval|all] --target-model ... --out DIR

Stages (each resumable, each reads what the previous one wrote under --out):
  prompts  (not part of `all`; run once, output checked in) the target writes
         self-instruct requests and answers a selection of them
         -> distill/prompt_sets/distill_generated.jsonl, then rebuilds the prompt set
         distill/prompt_sets/distill_prompts.jsonl from it
  data   target greedy responses + top-k log-probs for the training prompts
         (in --gen-dtype) and both held-out sets (in float32, the dtype the
         target is served in, so held-out labels are its true greedy tokens):
         the templated one (held out of the prompt file) and the separately
         built one (--heldout-file)
         -> OUT/data/{train,heldout,heldout_v2}/shard-*.pt
  train  draft = target embedding + first --layers layers + final norm + tied
         head (optionally --vocab rows), trained on the soft labels
         -> OUT/train/checkpoint.pt, then the draft folder OUT/draft/
         --kind eagle: the target's features of every training sequence
         (-> OUT/eagle-features/, resumable), then a feature head (fc + the
         target's last --layers layers + final norm + tied head) trained on them,
         --depth passes unrolled on its own features
         -> OUT/train/eagle-checkpoint.pt, then OUT/draft/ (kind eagle)
         --kind eagle3: an EAGLE-3 head over the streams entering the target's
         --aux-layers, kept by the data stage (distill.eagle3), trained with
         --depth unrolled passes, KL + --hard-weight x greedy cross-entropy
         -> OUT/draft/ in the published layout (config.json, model.safetensors)
  eval   agreement and tokens/pass on both held-out sets of OUT/draft (loaded
         through engine.model.loader, as the draft service loads it) and of
         the early-exit stand-in; cost ratio c and v(k) -> OUT/eval.json.
         --kind eagle: agreement, per-depth acceptance and tokens/pass of the
         head drafting on its own features (exact chain simulation), cost
         With --draft-model DIR: another draft folder on the same held-out data
         (e.g. the shipped one, for a side-by-side) -> OUT/eval-NAME.json
Serve the result with `python -m draft_service --model OUT/draft`.
The defaults (the shipped prompts in file order, 32 + 17 minute budgets for
data and training, then both held-out sets) finish in about an hour on a
2-core CPU; on a GPU, the budgets do
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

from distill.heldout import HELDOUT_V2_FILE
from distill.sources import (
    _amp, _target_loader_spec, generate_set, heldout_records, heldout_v2_prompts, load_target, pad_id,
)
from specdec.runtime.settings import POSITIONAL, Flag, Group, Settings

log = logging.getLogger("distill")
STAGES = ("prompts", "data", "train", "eval", "all")


SETTINGS = Settings("specdec distill", __doc__, env=False, groups=(
    Group("", (
        Flag("stage", "which stage to run", "all", kind=POSITIONAL, nargs="?", choices=STAGES),
        Flag("target-model", "target: 'default' (the embedded SmolLM2-135M-Instruct), a HF folder or a .gguf "
             "file", "default", aliases=("target",)),
        Flag("out", "working folder (data, checkpoints, draft, eval)", None, Path, required=True),
    )),
    Group("data", (
        Flag("prompts", "training prompts; 0 = all of the prompt file's", 0, int),
        Flag("prompt-file", "JSONL of {messages: [...]}; empty = the shipped set", None, Path),
        Flag("heldout", "templated held-out prompts, from the prompt file", 64, int),
        Flag("heldout-file", "JSONL of the separately built held-out set, evaluated next to the templated "
             "one; '' = none", str(HELDOUT_V2_FILE),
             default_doc="the shipped distill/prompt_sets/distill_heldout_v2.jsonl"),
        Flag("max-new-tokens", "response length cap", 192, int),
        Flag("gen-batch", "prompts per generation batch", 128, int),
        Flag("shard-prompts", "prompts per data shard, the unit of resumption (the continuously refilled "
             "batch drains at the end of each)", 256, int),
        Flag("gen-dtype", "target dtype for training data (held-out data is always float32); auto = bfloat16 "
             "where the device computes it natively, else float32", "auto"),
        Flag("top-k", "target log-probs stored per position", 20, int),
        Flag("sampled", "fraction of training prompts answered by sampling (T = 1 over the top-k) instead of "
             "greedily: more varied contexts; the labels stay the target's distribution", 0.0, float),
        Flag("data-minutes", "time budget of the data stage: no new shard after it; a rerun resumes "
             "(0 = none)", 32, float),
    )),
    Group("training", (
        Flag("kind", "draft kind: layers (the target's first --layers layers, reads tokens), eagle (an "
             "EAGLE-style feature head: the target's last --layers layers over [token embedding; target feature], "
             "drafting on its own features) or eagle3 (an EAGLE-3 head in the published layout: fc over the "
             "target's --aux-layers streams, one decoder layer over [token; feature], its own vocabulary)",
             "layers", choices=("layers", "eagle", "eagle3")),
        Flag("aux-layers", "eagle3: the target layers whose incoming residual streams the head reads, "
             "comma-separated; empty = EAGLE-3's 2, L // 2, L - 3",
             None, lambda v: tuple(int(x) for x in v.split(",") if x.strip())),
        Flag("layers", "decoder layers of the draft", None, int, default_doc="2 (layers), 1 (eagle)"),
        Flag("init-draft", "train stage: start from this draft folder (its layers, final norm and head "
             "vocabulary) instead of the target's first --layers layers: continued distillation of an "
             "existing draft on new data; empty = from the target", None, Path),
        Flag("vocab", "reduced head: the N most frequent tokens; 0 = full vocabulary", None, int,
             default_doc="8192 (layers, eagle), 24576 (eagle3: 99.0% of the hand-written held-out set's "
             "tokens against 90.8% for 8192, docs/draft-card.md)"),
        Flag("steps", "optimiser steps", 3000, int),
        Flag("batch-tokens", "response positions per step", 2048, int),
        Flag("lr", "peak learning rate", 2e-3, float),
        Flag("amp", "training autocast dtype; auto = bfloat16 where supported", "auto",
             choices=("auto", "bfloat16", "float32")),
        Flag("draft-dtype", "dtype of the stored draft tensors and of evaluation", "bfloat16"),
        Flag("train-minutes", "time budget of training: fewer steps if --steps would not fit (0 = none); "
             "for eagle it includes the feature extraction", 17, float),
        Flag("depth", "eagle: unrolled passes per step on the head's own features (training-time test; 1 = "
             "teacher-forced only)", 2, int),
        Flag("feature-weight", "eagle: weight of SmoothL1(head output, target feature) next to the soft "
             "cross-entropy", 0.1, float),
        Flag("hard-weight", "eagle3: weight of the cross-entropy to the target's greedy token next to the KL "
             "to its top-k", 0.5, float),
        Flag("feature-noise", "eagle: uniform noise on the true input features, relative to their RMS", 0.0, float),
        Flag("prompt-weight", "eagle: weight of the soft cross-entropy at prompt positions (0 = response "
             "positions only; the feature loss covers every position)", 0.0, float),
        Flag("feature-dtype", "eagle: target dtype of the training features when the data stage did not keep "
             "them (held-out features are always float32, as served); auto as --gen-dtype", "auto"),
    )),
    Group("evaluation", (
        Flag("draft-model", "eval stage: evaluate this draft folder instead of OUT/draft, without touching "
             "its manifest (results in OUT/eval-NAME.json)", None, Path, aliases=("draft",)),
    )),
    Group("process", (
        Flag("device", "cpu, cuda, cuda:0, ...", "cpu"),
        Flag("threads", "torch CPU threads", 2, int),
        Flag("seed", "torch's seed", 0, int),
        Flag("log-level", "DEBUG, INFO, WARNING...", "INFO"),
    )),
))


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def stage_prompts(args: argparse.Namespace) -> dict[str, Any]:
    """The model step of the prompt set (self-instruct requests and answers), in the generation dtype."""
    from distill import selfinstruct

    summary = selfinstruct.run(load_target(args, args.gen_dtype), batch_size=args.gen_batch)
    log.info("prompt set rebuilt: %s", summary)
    return summary


def stage_data(args: argparse.Namespace) -> dict[str, Any]:
    from distill import prompts

    prompt_set = prompts.load(args.prompt_file) if args.prompt_file else prompts.load()
    train_prompts, heldout_prompts = prompts.split(prompt_set, args.prompts or None, args.heldout)
    sets = [("heldout", heldout_prompts, "float32")]
    if args.heldout_file:
        sets.append(("heldout_v2", heldout_v2_prompts(args), "float32"))
    sets.append(("train", train_prompts, args.gen_dtype))
    summary: dict[str, Any] = {"target": args.target_model, "max_new_tokens": args.max_new_tokens, "top_k": args.top_k,
                               "sampled": args.sampled}
    if args.heldout_file:
        summary["heldout_file"] = args.heldout_file
    deadline = time.monotonic() + 60 * args.data_minutes if args.data_minutes > 0 else None
    for name, subset, dtype in sets:
        result = generate_set(args, name, subset, dtype, deadline if name == "train" else None)
        summary["tokenizer_fingerprint"] = result.pop("tokenizer_fingerprint")
        summary["target_name"] = result.pop("target_name")
        summary[name] = result
    if summary["train"]["prompts"]:
        train_ids = {p.id: p.category for p in train_prompts}
        summary["train"]["categories"] = category_counts(args, train_ids)
    (args.out / "data" / "info.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def category_counts(args: argparse.Namespace, categories: dict[int, str]) -> dict[str, int]:
    """Training prompts that made it into the data (the budget may cut the file short), per route/category."""
    from distill import data

    counts: dict[str, int] = {}
    for record in data.load_records(args.out / "data" / "train"):
        key = categories.get(record["id"], "?")
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def stage_train(args: argparse.Namespace) -> dict[str, Any]:
    from distill import data, train
    from engine.model import drafts

    if args.kind in ("eagle", "eagle3"):
        from distill import eagle, eagle3

        if args.init_draft is not None:
            raise SystemExit("--init-draft is for --kind layers")
        return (eagle if args.kind == "eagle" else eagle3).run_train(args)

    records = data.load_records(args.out / "data" / "train")
    if not records:
        raise SystemExit(f"no training data under {args.out / 'data' / 'train'}: run the data stage first")
    info = json.loads((args.out / "data" / "info.json").read_text())
    target = load_target(args, "float32")
    model = target.model
    vocab = target.vocab_size
    init = init_recipe(args, model)
    subset = drafts.subset_of(model)
    if args.init_draft is None:
        if 0 < args.vocab < vocab:
            subset = train.choose_subset(records, args.vocab, vocab, always=target.eos_token_ids)
        drafts.build_from_target(model, args.layers, subset)
    config = train.TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                               amp=_amp(args, target.device), seed=args.seed)
    pad = pad_id(target)
    log.info("training a %d-layer draft (%s head, %d trainable parameters) on %d sequences / %d tokens, amp %s",
             args.layers, f"{subset.numel()}-row" if subset is not None else "full", 
             sum(p.numel() for p in drafts.trainable_parameters(model)), len(records),
             sum(len(r["response"]) for r in records), config.amp)
    summary = train.train(model, records, config, args.out / "train" / "checkpoint.pt", pad_id=pad, vocab=vocab,
                          budget_s=60 * args.train_minutes if args.train_minutes > 0 else None)
    config = train.TrainConfig(**summary["config"])
    manifest = drafts.Manifest(
        target=drafts.target_spec(_target_loader_spec(args.target_model)),
        target_name=target.name,
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        num_layers=args.layers,
        vocab_subset=int(subset.numel()) if subset is not None else 0,
        dtype=args.draft_dtype,
        recipe={
            "method": "self-distillation: soft cross-entropy to the target's top-k log-probs",
            "init": init,
            "data": {k: info[k] for k in ("train", "heldout", "heldout_v2", "heldout_file", "max_new_tokens",
                                          "top_k") if k in info},
            "prompts": "distill/prompt_sets/distill_prompts.jsonl" if args.prompt_file is None else str(args.prompt_file),
            "train": {**{k: v for k, v in config.__dict__.items()}, "epochs": summary["epochs"],
                      "seconds": summary["seconds"], "final": summary["history"][-1] if summary["history"] else {}},
        },
    )
    out = drafts.save(model, args.out / "draft", manifest)
    log.info("draft written to %s", out)
    return summary


def init_recipe(args: argparse.Namespace, model: Any) -> str | dict[str, Any]:
    """Load --init-draft into `model` (a loaded target) when given; the manifest's description of the init."""
    from engine.model import drafts

    if args.init_draft is None:
        return f"target embedding + layers 0..{args.layers - 1} + final norm + tied head (frozen embedding/head)"
    previous = drafts.Manifest.read(args.init_draft)
    if previous.num_layers != args.layers:
        raise SystemExit(f"--init-draft {args.init_draft} has {previous.num_layers} layers, not --layers {args.layers}")
    drafts.load_trained(model, args.init_draft)  # its layers, norm and head subset, trainable again
    log.info("training continues from the draft %s", args.init_draft)
    return {"from_draft": str(args.init_draft), "its_recipe": previous.recipe, "its_eval": previous.eval}


def cost_variants(args: argparse.Namespace, target_model: Any, context: list[int],
                  subset: torch.Tensor | None) -> dict[str, Any]:
    """What the reduced head and the dtype buy: the draft's c with and without each.

    Timed on untrained drafts of the same shape (cost does not depend on the weights).
    """
    from distill import evaluate
    from engine.model import drafts

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


def evaluate_model(name: str, model: Any, sets: dict[str, list[dict[str, Any]]], target_model: Any,
                   context: list[int]) -> dict[str, Any]:
    """Quality on every held-out set (the templated one at top level, as before), cost, speed-ups."""
    from distill import evaluate

    cost = evaluate.cost(model, target_model, context)
    by_set = {}
    for set_name, records in sets.items():
        log.info("evaluating %s on %d %s responses", name, len(records), set_name)
        quality = evaluate.quality(model, records)
        by_set[set_name] = {**quality, **evaluate.speedups(quality["tokens_per_pass"], cost["c"], cost["v"],
                                                           quality["agreement"])}
    return {**by_set["heldout"], "cost": cost, "by_set": by_set}


def stage_eval(args: argparse.Namespace) -> dict[str, Any]:
    from distill import data, evaluate
    from engine.model import drafts
    from engine.model import loader

    if args.kind in ("eagle", "eagle3"):
        from distill import eagle, eagle3

        return (eagle if args.kind == "eagle" else eagle3).run_eval(args)

    sets = heldout_records(args)
    records = sets["heldout"]
    train_records = data.load_records(args.out / "data" / "train")
    folder = args.draft_model or args.out / "draft"
    trained = loader.load(str(folder), device=args.device, dtype=args.draft_dtype)
    target = load_target(args, "float32")
    context = (records[0]["prompt"] + records[0]["response"])[:256]
    result: dict[str, Any] = {"draft_folder": str(folder), "heldout_prompts": len(records),
                              "sets": {k: {"prompts": len(v), "positions": sum(len(r["response"]) for r in v)}
                                       for k, v in sets.items()}}
    subset = drafts.subset_of(trained.model)
    result["vocab_coverage"] = {k: round(evaluate.coverage(v, subset), 4) for k, v in sets.items()}
    result["vocab_coverage"]["train"] = round(evaluate.coverage(train_records, subset), 4)
    result["draft"] = evaluate_model("draft", trained.model, sets, target.model, context)
    result["draft"]["dtype"] = args.draft_dtype
    if args.draft_model is None:  # the stand-in and the cost variants do not depend on the draft's weights
        stand_in = loader.load(_target_loader_spec(args.target_model), device=args.device, dtype="float32",
                               num_layers=args.layers)
        result["stand_in"] = evaluate_model("stand-in", stand_in.model, sets, target.model, context)
        result["cost_variants"] = cost_variants(args, target.model, context, subset)
    result["threads"] = torch.get_num_threads()
    out = args.out / ("eval.json" if args.draft_model is None else f"eval-{folder.name}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    d = result["draft"]
    if args.draft_model is None:
        write_manifest_eval(folder, result)
    for set_name, q in d["by_set"].items():
        log.info("%s: %s agreement %.1f%%, tokens/pass at k=4 %s", folder, set_name, 100 * q["agreement"],
                 q["tokens_per_pass"][4])
    log.info("c = %.3f (%.2f ms vs %.2f ms)", d["cost"]["c"], d["cost"]["draft_ms"], d["cost"]["target_ms"])
    return result


def write_manifest_eval(folder: Path, result: dict[str, Any]) -> None:
    """The eval summary in the draft's manifest: templated held-out numbers, and the separate set's."""
    from engine.model import drafts

    d = result["draft"]
    summary = {k: d[k] for k in ("agreement", "tokens_per_pass", "best_k", "speedup", "cost")}
    summary |= {"stand_in_agreement": result["stand_in"]["agreement"], "vocab_coverage": result["vocab_coverage"],
                "heldout_positions": d["positions"]}
    if "heldout_v2" in d["by_set"]:
        v2 = d["by_set"]["heldout_v2"]
        summary["heldout_v2"] = {"agreement": v2["agreement"], "tokens_per_pass": v2["tokens_per_pass"],
                                 "best_k": v2["best_k"], "speedup": v2["speedup"], "positions": v2["positions"],
                                 "stand_in_agreement": result["stand_in"]["by_set"]["heldout_v2"]["agreement"]}
    manifest = drafts.Manifest.read(folder)
    drafts.Manifest(**{**manifest.__dict__, "eval": summary}).write(folder)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "distill.log")],
    )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.layers is None:
        args.layers = 1 if args.kind == "eagle" else 2
    if args.vocab is None:
        args.vocab = 24576 if args.kind == "eagle3" else 8192
    if args.layers < 1:
        raise SystemExit("--layers must be >= 1")
    if not 0.0 <= args.sampled <= 1.0:
        raise SystemExit(f"--sampled is a fraction of the training prompts, 0 to 1; got {args.sampled}")
    stages = ("data", "train", "eval") if args.stage == "all" else (args.stage,)
    for stage in stages:
        started = time.monotonic()
        log.info("stage %s: starting", stage)
        {"prompts": stage_prompts, "data": stage_data, "train": stage_train, "eval": stage_eval}[stage](args)
        log.info("stage %s: done in %.1f s", stage, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

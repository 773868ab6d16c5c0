"""Write a draft card (markdown) from a distill run: python -m distill.card OUT [--name NAME].

Everything in the card is read from the run folder (data/info.json, the draft
manifest, eval.json, and with --baseline another draft's eval-NAME.json from
`python -m distill eval --draft-model DIR --out OUT`), so the numbers are the
measured ones.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


SET_TITLES = {"heldout": "templated held-out (every 20th templated prompt)",
              "heldout_v2": "separate held-out v2 (hand-written)"}
ROUTES = ("templated: explanations, creative writing, code, arithmetic, rewriting, advice, comparisons and "
          "emails from templates x topics; self-instruct: requests written by the target itself; multi-turn: "
          "a self-instruct request, the target's answer, then a follow-up; quoted input: rewrite, summarize "
          "and code tasks that quote a passage, a code snippet or one of the target's answers")


def _set_rows(label: str, model: dict[str, Any]) -> list[str]:
    """One row per held-out set: agreement, tokens/pass at k = 4 and at the best k."""
    rows = []
    for set_name, q in model.get("by_set", {"heldout": model}).items():
        best = max(q["tokens_per_pass"], key=lambda k: q["tokens_per_pass"][k])
        rows.append(_row([label, SET_TITLES.get(set_name, set_name), q["positions"], f"{100 * q['agreement']:.1f}%",
                          q["tokens_per_pass"]["4"], f"{q['tokens_per_pass'][best]} (k = {best})"]))
    return rows


def comparison(result: dict[str, Any], baseline: dict[str, Any], baseline_name: str) -> list[str]:
    """The previous draft against this one, per held-out set, on the same held-out data."""
    lines = [_row(["held-out set", "positions", f"{baseline_name}: agreement", "this draft: agreement",
                   f"{baseline_name}: tokens / pass (k = 4)", "this draft: tokens / pass (k = 4)"]),
             _row(["---"] * 6)]
    for set_name, q in result["draft"]["by_set"].items():
        b = baseline["draft"]["by_set"].get(set_name)
        if b is None:
            continue
        lines.append(_row([SET_TITLES.get(set_name, set_name), q["positions"], f"{100 * b['agreement']:.1f}%",
                           f"{100 * q['agreement']:.1f}%", b["tokens_per_pass"]["4"], q["tokens_per_pass"]["4"]]))
    return lines


def init_text(init: Any) -> str:
    """Where the trained layers started: the target, or (continued distillation) an earlier draft."""
    if not isinstance(init, dict):
        return "initialised from the target"
    before = init.get("its_recipe", {}).get("data", {}).get("train", {})
    return (f"continued from the earlier draft `{init['from_draft']}`, which was initialised from the target and "
            f"trained on {before.get('prompts', '?')} templated prompts / {before.get('tokens', 0):,} response tokens"
            f" for {init.get('its_recipe', {}).get('train', {}).get('steps', '?')} steps")


def render(out: Path, name: str, licence: str, baseline: Path | None = None,
           baseline_name: str = "previous draft") -> str:
    info = json.loads((out / "data" / "info.json").read_text())
    manifest = json.loads((out / "draft" / "specdec-draft.json").read_text())
    result = json.loads((out / "eval.json").read_text())
    lines = _folder_section(name, manifest) + _data_section(info) + _recipe_section(manifest, info)
    lines += _heldout_section(result)
    if baseline is not None:
        base = json.loads(baseline.read_text())
        lines += [
            f"Against the {baseline_name} (`{base.get('draft_folder', baseline.name)}`), evaluated by the same "
            "code on the same held-out data:",
            "",
            *comparison(result, base, baseline_name),
            "",
        ]
    lines += _templated_section(result, manifest) + _goals_section(result["draft"])
    lines += _closing_sections(result, licence)
    return "\n".join(lines) + "\n"


def _folder_section(name: str, manifest: dict[str, Any]) -> list[str]:
    """The title, what the draft is for, and the files of its folder."""
    return [
        f"# Draft card: `{name}`",
        "",
        f"A draft model for **{manifest['target_name']}** ({manifest['target']}), made by "
        "`python -m distill` (self-distillation). The draft service serves it when it is "
        "given no `--model`; any draft folder loads with `python -m draft_service --model DIR`.",
        "",
        "## What is in the folder",
        "- `specdec-draft.json`: the manifest (base target, tokenizer fingerprint, recipe, eval).",
        f"- `draft.safetensors`: only the trained tensors, stored in {manifest['dtype']}: decoder layers "
        f"0..{manifest['num_layers'] - 1} and the final norm"
        + (f", plus the ids of the {manifest['vocab_subset']}-token head vocabulary." if manifest["vocab_subset"] else "."),
        "- The embedding and the (tied) LM head are the target's, frozen, taken from the target at load "
        "time" + (" (the embedded GGUF, converted once to the model cache)." if manifest["target"] == "embedded default"
                  else "."),
        "",
    ]


def _data_section(info: dict[str, Any]) -> list[str]:
    """Prompts, held-out sets and responses (data/info.json)."""
    return [
        "## Data",
        f"- Prompts: the shipped set `distill/prompt_sets/distill_prompts.jsonl`, four routes ({ROUTES}); the "
        "target's requests and answers come from `python -m distill prompts` and are checked in "
        "(`distill/prompt_sets/distill_generated.jsonl`). "
        f"{info['train']['prompts']} training prompts were used (the data budget cuts the file short; the "
        "new routes are interleaved with the templated prompts so every prefix holds them in proportion)"
        + (": " + ", ".join(f"{k} {v}" for k, v in info["train"]["categories"].items())
           if "categories" in info["train"] else "") + ".",
        f"- Held-out sets: the templated one ({info['heldout']['prompts']} prompts, every 20th prompt of the "
        "templated route: disjoint from training but from the same templates and topics)"
        + (f", and a separately built one, `{Path(info['heldout_file']).name}` ({info['heldout_v2']['prompts']} "
           "hand-written prompts: explanations, code, rewriting and summarizing quoted input, multi-turn "
           "follow-ups, advice, creative writing, math; wording, passages and code of its own, never trained "
           "on, and not the benchmark suite)" if "heldout_v2" in info else "") + ".",
        f"- Responses: the target's own greedy continuations, at most {info['max_new_tokens']} tokens, "
        f"with its top-{info['top_k']} log-probs at every position (stored during generation). "
        f"Training data: {info['train']['tokens']:,} response tokens generated with the target in "
        f"{info['train']['dtype']}" + (" (3x faster than float32 on this CPU; a near-identical distribution)"
                                       if info["train"]["dtype"] != "float32" else "") + ". Held-out data: "
        f"{info['heldout']['tokens']:,} tokens generated in {info['heldout']['dtype']}, the dtype the target "
        "is served in, so held-out labels are its true greedy tokens.",
        "",
    ]


def _recipe_section(manifest: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """Architecture, loss, optimiser and the final training figures (the manifest's recipe)."""
    train = manifest["recipe"]["train"]
    final = train.get("final", {})
    return [
        "## Recipe",
        f"- Architecture: the target's embedding + its first {manifest['num_layers']} decoder layers "
        f"({init_text(manifest['recipe'].get('init'))}) + final norm + tied head"
        + (f" restricted to the {manifest['vocab_subset']} most frequent tokens of the "
           + ("earlier draft's " if isinstance(manifest["recipe"].get("init"), dict) else "")
           + "training responses "
           "(logits -inf elsewhere, so q = 0 there; rejection sampling stays exact)." if manifest["vocab_subset"] else "."),
        f"- Loss: soft cross-entropy to the target's top-{info['top_k']} distribution (renormalised over the "
        "tokens the head can emit), on response positions only.",
        f"- Optimiser: AdamW, peak lr {train['lr']}, weight decay {train['weight_decay']}, "
        f"{int(train['warmup'] * 100)}% linear warm-up, cosine to {train['min_lr']} x peak; "
        f"{train['steps']} steps of ~{train['batch_tokens']} response positions "
        f"({train['epochs']} passes over the data), "
        + ("float32 (no autocast)" if train["amp"] == "float32" else f"{train['amp']} autocast")
        + f", {train['seconds']:.0f} s.",
        f"- Final training loss {final.get('loss', '?')}, training agreement {final.get('train_agreement', '?')}.",
        "",
    ]


def _heldout_section(result: dict[str, Any]) -> list[str]:
    """Agreement and tokens per pass per held-out set, this draft and the early-exit stand-in."""
    return [
        "## Held-out results",
        "Teacher-forced greedy agreement and simulated tokens per target pass, per held-out set:",
        "",
        _row(["model", "held-out set", "positions", "greedy agreement", "tokens / pass (k = 4)",
              "tokens / pass (best k)"]),
        _row(["---"] * 6),
        *_set_rows("this draft", result["draft"]),
        *_set_rows("early-exit stand-in", result["stand_in"]),
        "",
    ]


def _best_tpp(d: dict[str, Any]) -> str:
    """The k (a JSON key) with the most tokens per target pass."""
    return max(sorted(d["tokens_per_pass"], key=int), key=lambda k: d["tokens_per_pass"][k])


def _templated_section(result: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """The templated held-out set in detail: costs, coverage, the table per k, what head and dtype buy."""
    d, s = result["draft"], result["stand_in"]
    ks = sorted(d["tokens_per_pass"], key=int)
    best_tpp = _best_tpp(d)
    lines = [
        f"The rest of this section is on the templated held-out set ({d['positions']:,} response positions; "
        f"{result['threads']} CPU threads for the timings).",
        "",
        _row(["", "greedy agreement", f"tokens / target pass (best k = {best_tpp})", "forward ms", "c"]),
        _row(["---"] * 5),
        _row([f"this draft ({d.get('dtype', manifest['dtype'])})", f"{100 * d['agreement']:.1f}%",
              d["tokens_per_pass"][best_tpp], d["cost"]["draft_ms"], d["cost"]["c"]]),
        _row([f"early-exit stand-in ({manifest['num_layers']} layers, float32, full head)",
              f"{100 * s['agreement']:.1f}%", s["tokens_per_pass"][best_tpp], s["cost"]["draft_ms"], s["cost"]["c"]]),
        _row(["target decode step (float32)", "", "", d["cost"]["target_ms"], 1.0]),
        "",
        f"Vocabulary coverage of the head: {100 * result['vocab_coverage']['heldout']:.1f}% of templated "
        "held-out response tokens"
        + (f", {100 * result['vocab_coverage']['heldout_v2']:.1f}% of the separate set's"
           if "heldout_v2" in result["vocab_coverage"] else "")
        + f" ({100 * result['vocab_coverage']['train']:.1f}% of training tokens).",
        "",
        "Tokens per target pass at k drafted tokens, simulated exactly from the per-position agreement "
        "pattern (greedy: a round accepts the agreeing run, at most k, plus one target token), the i.i.d. "
        "formula (1 - a^(k+1)) / (1 - a) at the measured agreement a, the measured verify cost v(k) "
        "(target forward over k + 1 tokens / one token), the expected speed-up E / (v(k) + k c) and "
        "the break-even acceptance rate for this c and v(k):",
        "",
        _row(["k"] + ks),
        _row(["---"] * (len(ks) + 1)),
        _row(["tokens / pass (simulated)"] + [d["tokens_per_pass"][k] for k in ks]),
        _row(["tokens / pass (i.i.d. formula)"] + [d["tokens_per_pass_iid"][k] for k in ks]),
        _row(["v(k)"] + [d["cost"]["v"][k] for k in ks]),
        _row(["expected speed-up"] + [d["speedup"][k] for k in ks]),
        _row(["break-even alpha"] + [d["break_even_alpha"][k] if d["break_even_alpha"][k] is not None else "never"
                                     for k in ks]),
        "",
        "What the reduced head and the dtype buy (untrained drafts of the same shape, one-token forward "
        "with a KV cache, interleaved with the target):",
        "",
        _row(["draft weights / head", "draft ms", "target ms", "c"]),
        _row(["---"] * 4),
    ]
    for key, cost in result.get("cost_variants", {}).items():
        lines.append(_row([key, cost["draft_ms"], cost["target_ms"], cost["c"]]))
    return lines


def _goals_section(d: dict[str, Any]) -> list[str]:
    """The draft against issue 6's goals (and issue 11's on the separate set), and the expected speed-up."""
    best_tpp = _best_tpp(d)
    best_speed = str(d["best_k"])  # JSON keys are strings
    return [
        "",
        "## Against the goals of issue 6",
        "",
        _row(["goal", "measured", "met"]),
        _row(["---"] * 3),
        _row(["held-out greedy agreement >= 45%", f"{100 * d['agreement']:.1f}%", "yes" if d["agreement"] >= 0.45 else "no"]),
        *([_row(["issue 11: agreement >= 50% on the separate held-out set",
                 f"{100 * d['by_set']['heldout_v2']['agreement']:.1f}%",
                 "yes" if d["by_set"]["heldout_v2"]["agreement"] >= 0.5 else "no"])]
          if "heldout_v2" in d.get("by_set", {}) else []),
        _row(["tokens per target pass >= 1.7 at the best k", f"{d['tokens_per_pass'][best_tpp]} (k = {best_tpp})",
              "yes" if d["tokens_per_pass"][best_tpp] >= 1.7 else "no"]),
        _row(["draft forward <= 5 ms", f"{d['cost']['draft_ms']} ms", "yes" if d["cost"]["draft_ms"] <= 5 else "no"]),
        _row(["c <= 0.12", d["cost"]["c"], "yes" if d["cost"]["c"] <= 0.12 else "no"]),
        "",
        f"Expected speed-up at the best k ({best_speed}): {d['speedup'][best_speed]}x, from the simulated tokens "
        f"per pass and the measured c and v(k); the break-even acceptance rate there is "
        f"{d['break_even_alpha'][best_speed]}. These are estimates from teacher-forced held-out text; the services "
        "benchmark (benchmarks/run/) measures the real wall-clock ratio through gRPC.",
        "",
    ]


def _closing_sections(result: dict[str, Any], licence: str) -> list[str]:
    """Caveats, the licence and the commands that reproduce the draft and this page."""
    v = result["draft"]["cost"]["v"]
    return [
        "## Caveats",
        "- The templated held-out prompts are disjoint from the training prompts but come from the same "
        "templates and topics, so their agreement is in-distribution; the separate held-out set is the "
        "better guide to other prompts, and sampled decoding accepts less than greedy agreement suggests.",
        f"- v(k) was measured between {min(v.values())} and {max(v.values())} here: "
        "a target forward over a few tokens costs that much more than a one-token forward on this CPU "
        "(small matrix products), which raises the break-even acceptance rate.",
        "- Timings are medians on a shared 2-core machine, taken interleaved; absolute milliseconds move "
        "with load, the ratios less so.",
        "",
        "## Licence",
        licence,
        "",
        "## Reproduce",
        "```",
        "python -m distill prompts --out OUT   # optional: the checked-in self-instruct step",
        f"python -m distill all --target-model default --out OUT --threads {result['threads']}",
        "python -m distill eval --out OUT --draft-model PREVIOUS_DRAFT   # the side-by-side",
        "python -m distill.card OUT --baseline OUT/eval-NAME.json > docs/draft-card.md   # this page",
        "```",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distill.card", description=__doc__)
    p.add_argument("out", type=Path, help="the --out folder of a distill run")
    p.add_argument("--name", default="specdec/drafts/smollm2-135m")
    p.add_argument("--licence", default=(
        "SmolLM2-135M-Instruct is released by Hugging Face under the Apache-2.0 licence; this draft is "
        "derived from its weights and outputs and is distributed under Apache-2.0 as well."))
    p.add_argument("--baseline", type=Path, default=None,
                   help="eval-NAME.json of another draft (eval --draft) to compare with, per held-out set")
    p.add_argument("--baseline-name", default="previous draft")
    args = p.parse_args(argv)
    sys.stdout.write(render(args.out, args.name, args.licence, args.baseline, args.baseline_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

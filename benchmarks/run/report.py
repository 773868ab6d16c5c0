"""Markdown tables and PNG plots from a benchmark result (the JSON `python -m benchmarks.run` writes).

Re-render a saved run: `python -m benchmarks.run.report path/to/results.json`.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.run import analysis

PLOTS = ("speedup_vs_k.png", "breakdown.png", "acceptance_by_position.png", "speedup_vs_rtt.png")


def _f(x, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt)


def _link(s: dict) -> str:
    parts = []
    if s.get("rtt_ms") is not None:
        parts.append(f"RTT {s['rtt_ms']:g} ms")
    if s.get("rate_mbps") is not None:
        parts.append("uncapped" if not s["rate_mbps"] else f"{s['rate_mbps']:g} Mbit/s")
    return ", ".join(parts) or "direct"


def markdown(result: dict) -> str:
    summaries = result["summaries"]
    main = [s for s in summaries if s["phase"] == "main"]
    lines = _header(result) + _identity_section(result["checks"])
    lines += _throughput_section(main)
    lines += _breakdown_section(main)
    lines += _acceptance_section(main)
    for model in result.get("models", []):
        if model:
            lines += _model_section(model)
    lines += _parallel_section(result, main)
    lines += _category_section(result)
    lines += _prediction_section(summaries)
    lines += _structured_section(summaries)
    lines += _network_section(result)
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in result.get("plots", [])]
    lines.append("")
    return "\n".join(lines)


def _header(result: dict) -> list[str]:
    """The title and what ran where: command, models, machine, prompts, sampling."""
    env, cfg = result["environment"], result["settings"]
    return [
        f"# specdec benchmark ({'quick' if cfg.get('quick') else 'full'} mode)",
        "",
        f"- command: `{cfg.get('command', '')}`",
        f"- target: {env.get('target_model')}; draft: {env.get('draft_model')}; "
        f"device {cfg.get('device')}, dtype {cfg.get('dtype')}, {cfg.get('threads')} torch threads",
        f"- CPU: {env.get('cpu')} ({env.get('cpu_count')} cores); torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}; git {env.get('git_commit')}",
        f"- prompts: {cfg.get('n_prompts')} from {cfg.get('suite')} "
        f"({cfg.get('per_category')} per category), max_new_tokens {cfg.get('max_new_tokens')}, "
        f"{cfg.get('reps')} repetitions, configs interleaved per prompt and repetition",
        f"- sampling mode: temperature {cfg.get('temperature')}, top_p {cfg.get('top_p')}",
        "",
    ]


def _identity_section(checks: dict) -> list[str]:
    """Greedy identity through the services, then the in-process peer against it."""
    lines = ["## Greedy identity", ""]
    bad = checks["greedy_mismatches"]
    if bad:
        lines.append(f"**FAILED**: {len(bad)} greedy speculative outputs differ from target-only "
                     "through the services:")
        lines.append("")
        for m in bad[:50]:
            lines.append(f"- {m['prompt_id']} {m['config']} ({m['phase']}, rep {m['rep']}): "
                         f"first difference at token {m['first_difference']}")
    else:
        lines.append(f"PASSED: all {checks['greedy_compared']} greedy speculative outputs equal "
                     "target-only through the services, token for token.")
    peer_bad = checks["peer_mismatches"]
    lines.append("")
    lines.append(
        f"In-process peer (transformers `generate`) vs target-only through the services: "
        f"{len(peer_bad)} of {checks['peer_compared']} greedy outputs differ"
        + (" (" + ", ".join(f"{m['config']}:{m['prompt_id']}@{m['first_difference']}"
                             for m in peer_bad[:12]) + ")" if peer_bad else "") + ".")
    return lines


def _throughput_section(main: list[dict]) -> list[str]:
    """Tokens/s, passes, acceptance, k, TTFT and the ratios, per mode and configuration."""
    lines = ["", "## Throughput", "",
             "tokens/s is the median over repetitions of (tokens / seconds summed over prompts), "
             "with min–max; ratios divide medians. k used = the k the rounds asked the proposer "
             "for (`Stats.rounds[].k`), mean [min–max]: the config's k, less in a request's last "
             "rounds; for svc-draft-auto what the orchestrator's adaptive k chose; for a tree "
             "configuration also the mean tree size (tokens per tree round).", ""]
    lines.append("| mode | config | tokens/s (min–max) | target passes/token | mean accepted "
                 "| k used | TTFT ms | × svc-none | × hf-target | × hf twin |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for s in main:
        twin = f"{_f(s['vs_hf_twin'])} ({s['hf_twin']})" if s.get("hf_twin") else "–"
        lines.append(
            f"| {s['mode']} | {s['config']} | {_f(s['tps_median'], '.1f')} "
            f"({_f(s['tps_min'], '.1f')}–{_f(s['tps_max'], '.1f')}) | "
            f"{_f(s['passes_per_token'], '.3f')} | "
            f"{_f(s.get('mean_accepted')) if s['proposer'] not in ('none', 'target') else '–'} | "
            f"{_k_used(s)} | "
            f"{_f(s['ttft_ms_median'], '.0f')} | {_f(s['vs_svc_none'])} | "
            f"{_f(s['vs_hf_target'])} | {twin} |"
        )
    return lines


def _median_p90(b: dict, name: str) -> str:
    """One breakdown part as "median [p90]"."""
    if name not in b:
        return "–"
    return f"{_f(b[name]['median'], '.2f')} [{_f(b[name]['p90'], '.2f')}]"


def _breakdown_section(main: list[dict]) -> list[str]:
    """Where a round's time goes, per configuration through the services."""
    lines = ["", "## Per-round breakdown (services)", "",
             "Milliseconds per round from `Stats.rounds`, median [p90] over every round of "
             "every request of a configuration (cells marked * come from records without "
             "rounds: a request's totals / its target passes, over requests). draft / target = "
             "the services' own compute; serialize = the orchestrator's protobuf encode + "
             "decode; network = RPC time − service time − serialize (wire, gRPC, the "
             "services' own (de)serialisation); Redis = time a round waited on Redis (the "
             "write of the previous round overlaps this round's RPCs; hidden write time is "
             "not counted); orchestrator = the rest (verify, bookkeeping, detokenise, "
             "stream). non-compute = 1 − (draft + target) / round total, median over rounds "
             "(time-weighted over all rounds in parentheses). Round 1 also carries the "
             "prompt's prefill and the session set-up (its median total is shown apart).", ""]
    lines.append("| mode | config | rounds | draft | target | serialize | network | orchestrator "
                 "| Redis | round total | round 1 | non-compute | bytes → / ← per round |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in main:
        b = s.get("breakdown")
        if not b:
            continue
        first = b.get("first_round_ms")
        share = b.get("non_compute_share_pooled", math.nan)
        pooled = "" if math.isnan(share) else f" ({100 * share:.0f}%)"
        lines.append(
            f"| {s['mode']} | {s['config']} | {b.get('rounds', '*') if b.get('per_round') else '*'} | "
            f"{_median_p90(b, 'draft_ms')} | {_median_p90(b, 'target_ms')} | {_median_p90(b, 'serialize_ms')} | "
            f"{_median_p90(b, 'network_ms')} | {_median_p90(b, 'orchestrator_ms')} | {_median_p90(b, 'redis_ms')} | "
            f"{_median_p90(b, 'total_ms')} | "
            f"{_f(first['median'], '.1f') if first else '–'} | "
            f"{_f(100 * b['non_compute_share']['median'], '.0f')}%{pooled} | "
            f"{_f(b['bytes_sent_per_round']['median'], '.0f')} / "
            f"{_f(b['bytes_received_per_round']['median'], '.0f')}{_features(b)} |"
        )
    return lines


def _acceptance_section(main: list[dict]) -> list[str]:
    """P(draft token i accepted | the earlier ones were), per drafting configuration."""
    accept = [s for s in main if s.get("acceptance_by_position")]
    if not accept:
        return []
    width = max(len(s["acceptance_by_position"]) for s in accept)
    lines = ["", "## Acceptance by position (services, draft)", "",
             "P(draft token i accepted | tokens 1..i−1 accepted), pooled over requests.", "",
             "| mode | config | α | " + " | ".join(f"pos {i}" for i in range(1, width + 1)) + " |"]
    lines.append("|---|---|---|" + "---|" * width)
    for s in accept:
        rates = [_f(x) for x in s["acceptance_by_position"]] + [""] * (
            width - len(s["acceptance_by_position"]))
        lines.append(f"| {s['mode']} | {s['config']} | {_f(s.get('alpha'), '.3f')} | "
                     + " | ".join(rates) + " |")
    return lines


def _model_section(model: dict) -> list[str]:
    """The closed-form speed-up model against the measurement, per k, for one mode."""
    lines = ["", f"## Model vs measurement ({model['mode']})", "",
             f"α pooled over the fixed-k draft configs = {_f(model['alpha_pooled'], '.3f')}; "
             f"T1 (target ms per pass, no proposer) = {_f(model['t1_ms'], '.1f')}. "
             "Predicted tokens/pass = (1 − α^(k+1)) / (1 − α); predicted speed-up = "
             "E / (v + k·c) with v = target ms per pass at k / T1, c = draft ms per drafted "
             "token / T1 (compute only: the model sees no network, orchestrator or Redis).",
             "",
             "| k | α (this k) | tokens/pass measured | predicted | c | v | speed-up measured "
             "| predicted | round ms measured | model compute ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in model["rows"]:
        lines.append(
            f"| {r['k']} | {_f(r['alpha'], '.3f')} | {_f(r['tokens_per_pass_measured'])} | "
            f"{_f(r['tokens_per_pass_predicted'])} | {_f(r['c'], '.3f')} | {_f(r['v'], '.3f')} | "
            f"{_f(r['speedup_measured'])} | {_f(r['speedup_predicted'])} | "
            f"{_f(r['round_ms_measured'], '.1f')} | {_f(r['round_ms_model'], '.1f')} |"
        )
    a = model.get("adaptive")
    if a:
        lines.append(
            f"| auto (mean {_f(a['k_mean'])}, {_f(a['k_min'], 'd')}–{_f(a['k_max'], 'd')}) | "
            f"{_f(a['alpha'], '.3f')} | {_f(a['tokens_per_pass_measured'])} | – | – | – | "
            f"{_f(a['speedup_measured'])} | – | {_f(a['round_ms_measured'], '.1f')} | – |")
        lines += ["", f"{a['config']}: the orchestrator picks k each round from the acceptance "
                  "and draft/target costs it has observed so far, so k varies and the "
                  "closed-form prediction does not apply; the row shows what it measured "
                  "and the mean k its rounds used."]
    return lines


def _network_section(result: dict) -> list[str]:
    """The RTT sweep and the rate cap: speed-ups over the same link and against no link."""
    summaries = result["summaries"]
    net = [s for s in summaries if s["phase"] in ("rtt", "rate")]
    if not net:
        return []
    lines = ["", "## Network between orchestrator and services", "",
             f"Link: **{result.get('link', {}).get('kind', '?')}** — "
             f"{result.get('link', {}).get('note', '')}", "",
             "Speed-up is against target-only through the same link (svc-none at the same "
             "RTT / rate); × svc-none direct compares with target-only with no emulated "
             "link, measured interleaved in the same phase. The rate phase samples with "
             f"top_p {result['settings'].get('rate_top_p')}.", "",
             "| phase | mode | link | config | tokens/s (min–max) | speed-up same link "
             "| predicted from RTT 0 | × svc-none direct | network ms/round "
             "| bytes → / ← per round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    direct = {(s["phase"], s["mode"]): s for s in net
              if s.get("rtt_ms") is None and s["config"] == "svc-none"}
    for s in net:
        d = direct.get((s["phase"], s["mode"]))
        b = s["breakdown"]
        lines.append(
            f"| {s['phase']} | {s['mode']} | {_link(s)} | {s['config']} | "
            f"{_f(s['tps_median'], '.1f')} ({_f(s['tps_min'], '.1f')}–{_f(s['tps_max'], '.1f')}) | "
            f"{_f(s['vs_svc_none'])} | {_f(_rtt_pred(summaries, s))} | "
            f"{_f(s['tps_median'] / d['tps_median']) if d else '–'} | "
            f"{_f(b['network_ms']['median'], '.1f')} | "
            f"{_f(b['bytes_sent_per_round']['median'], '.0f')} / "
            f"{_f(b['bytes_received_per_round']['median'], '.0f')}{_features(b)} |"
        )
    best = best_k_per_rtt(summaries)
    if best:
        lines += ["", "Best configuration at each RTT (greedy): " + "; ".join(
            f"{rtt:g} ms → {cfg} (×{_f(sp)})" for rtt, cfg, sp in best) + "."]
    return lines


def _features(b: dict) -> str:
    """A feature draft's share of the bytes per round (median), where there is one."""
    f = b.get("feature_bytes_per_round")
    return f" (features {_f(f['median'], '.0f')})" if f and f.get("median") else ""


def _k_used(s: dict) -> str:
    if s.get("k_mean") is None:
        return "–"
    tree = f"; tree {_f(s['tree_nodes_mean'], '.1f')} nodes" if s.get("tree_rounds") else ""
    return f"{_f(s['k_mean'])} [{s['k_min']}–{s['k_max']}]{tree}"


def _rtt_pred(summaries: list[dict], s: dict) -> float:
    if s["phase"] != "rtt" or s.get("rtt_ms") is None or s["config"] == "svc-none":
        return math.nan
    return analysis.rtt_prediction(summaries, s["config"], s["rtt_ms"])


def best_k_per_rtt(summaries: list[dict]) -> list[tuple[float, str, float]]:
    rows = [s for s in summaries if s["phase"] == "rtt" and s["mode"] == "greedy"
            and s["rtt_ms"] is not None]
    out = []
    for rtt in sorted({s["rtt_ms"] for s in rows}):
        cells = [s for s in rows if s["rtt_ms"] == rtt]
        if cells:
            top = max(cells, key=lambda s: s["vs_svc_none"] if not math.isnan(s["vs_svc_none"]) else -1)
            out.append((rtt, top["config"], top["vs_svc_none"]))
    return out


def plots(result: dict, out_dir: Path) -> list[str]:
    """Write the PNGs; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [s for s in result["summaries"] if s["phase"] == "main"]
    modes = [m for m in ("greedy", "sampling") if any(s["mode"] == m for s in main)]
    written = []
    for name, draw, args in (("speedup_vs_k.png", _speedup_vs_k_plot, (result, main, modes)),
                             ("breakdown.png", _breakdown_plot, (main,)),
                             ("acceptance_by_position.png", _acceptance_plot, (main, modes)),
                             ("speedup_vs_rtt.png", _rtt_plot, (result,))):
        fig = draw(plt, *args)  # None: nothing to plot
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def _speedup_vs_k_plot(plt, result: dict, main: list[dict], modes: list[str]):
    """Speed-up vs k, measured and predicted, with adaptive k and the in-process peer."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, mode in enumerate(modes):
        color = f"C{i}"
        draft = sorted((s for s in main if s["mode"] == mode and s["proposer"] == "draft"
                        and s["family"] == "svc" and s["k"]), key=lambda s: s["k"])
        if draft:
            ax.plot([s["k"] for s in draft], [s["vs_svc_none"] for s in draft], "o-",
                    color=color, label=f"{mode}: measured (services)")
        auto = next((s for s in main if s["mode"] == mode and analysis.is_adaptive(s)
                     and s.get("k_mean") is not None), None)
        if auto:  # placed at the mean k its rounds used
            ax.plot([auto["k_mean"]], [auto["vs_svc_none"]], "*", ms=12, color=color,
                    label=f"{mode}: adaptive k (at its mean k)")
        model = next((m for m in result.get("models", []) if m and m["mode"] == mode), None)
        if model:
            ax.plot([r["k"] for r in model["rows"]], [r["speedup_predicted"] for r in model["rows"]],
                    "s--", color=color, alpha=0.6, label=f"{mode}: E/(v+k·c), α={model['alpha_pooled']:.2f}")
        peer = sorted((s for s in main if s["mode"] == mode and s["proposer"] == "assisted"),
                      key=lambda s: s["k"])
        base = next((s for s in main if s["mode"] == mode and s["config"] == "hf-target"), None)
        if peer and base:
            ax.plot([s["k"] for s in peer], [s["tps_median"] / base["tps_median"] for s in peer],
                    "^:", color=color, alpha=0.8, label=f"{mode}: in-process assisted vs hf-target")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("k (drafted tokens per round)")
    ax.set_ylabel("speed-up over target-only")
    ax.set_title("Speed-up vs k")
    ax.legend(fontsize=7)
    return fig


def _breakdown_plot(plt, main: list[dict]):
    """The per-round time breakdown, stacked bars; None without breakdowns."""
    cells = [s for s in main if s.get("breakdown")]
    if not cells:
        return None
    fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(cells)), 4.8))
    x = range(len(cells))
    bottom = [0.0] * len(cells)
    for j, comp in enumerate(analysis.COMPONENTS):
        # Means stack to the mean round (medians of parts would not add up).
        vals = [s["breakdown"][comp].get("mean", s["breakdown"][comp]["median"]) for s in cells]
        vals = [0.0 if math.isnan(v) else v for v in vals]
        ax.bar(x, vals, bottom=bottom, color=f"C{j}", label=comp.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{s['config'].removeprefix('svc-')}\n{s['mode'][:4]}" for s in cells],
                       fontsize=7)
    ax.set_ylabel("ms per round (mean over rounds)")
    ax.set_title("Where a round's time goes")
    ax.legend(fontsize=7)
    return fig


def _acceptance_plot(plt, main: list[dict], modes: list[str]):
    """Acceptance by draft position, one panel per mode."""
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(6 * max(1, len(modes)), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for s in sorted((s for s in main if s["mode"] == mode and s.get("acceptance_by_position")),
                        key=lambda s: s["k"] or 10**6):
            rates = s["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, "o-", ms=3,
                    label=f"k={s['k']}" if s["k"] else "auto")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | earlier accepted)")
        ax.set_title(f"Acceptance by position ({mode})")
        ax.legend(fontsize=7)
    return fig


def _rtt_plot(plt, result: dict):
    """Speed-up vs RTT over the same link and against no link; None without an RTT phase."""
    summaries = result["summaries"]
    rtt = [s for s in summaries if s["phase"] == "rtt"]
    if not rtt:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    direct = next((s for s in rtt if s["rtt_ms"] is None and s["config"] == "svc-none"), None)
    for cfg in sorted({s["config"] for s in rtt}, key=lambda c: (c != "svc-none", c)):
        pts = sorted((s for s in rtt if s["config"] == cfg and s["mode"] == "greedy"
                      and s["rtt_ms"] is not None), key=lambda s: s["rtt_ms"])
        xs = [s["rtt_ms"] for s in pts]
        if cfg != "svc-none":
            line, = axes[0].plot(xs, [s["vs_svc_none"] for s in pts], "o-", label=cfg)
            grid = [x / 4 for x in range(int(4 * max(xs, default=0)) + 1)]
            axes[0].plot(grid, [analysis.rtt_prediction(summaries, cfg, x) for x in grid],
                         "--", color=line.get_color(), alpha=0.5,
                         label=f"{cfg}: E(T_t+R)/(T_r+2R)")
        if direct:
            axes[1].plot(xs, [s["tps_median"] / direct["tps_median"] for s in pts], "o-",
                         label=cfg)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_title("Speed-up vs target-only over the same link")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_title("Throughput relative to target-only with no link")
    kind = result.get("link", {}).get("kind", "")
    for ax in axes:
        ax.set_xlabel(f"RTT orchestrator ↔ services, ms ({kind})")
        ax.set_ylabel("ratio of tokens/s")
        ax.legend(fontsize=7)
    return fig


def _parallel_section(result: dict, main: list[dict]) -> list[str]:
    """Sequential vs parallel speculation at each k: speed, hits, the round breakdown, the model."""
    par = [s for s in main if s.get("parallel")]
    if not par:
        return []
    seq = {(s["mode"], s["k"]): s for s in main
           if s["proposer"] == "draft" and s["k"] and not s.get("parallel")}
    models = {m["mode"]: m for m in result.get("models", []) if m}
    lines = ["", "## Sequential vs parallel speculation (services, draft)", "",
             "Parallel: the draft drafts round n+1 (assuming round n fully accepted, with its own "
             "guess of the bonus token) while the target verifies round n; a hit round uses it "
             "and makes no draft call. hit rate = hit rounds / drafting rounds after the first "
             "(modelled: α^(k+1)). draft ms = median per round on the critical path; hidden = "
             "the pre-draft compute that overlapped the verify, per hit. Predicted = "
             "E / (v + (1 − h)·k·c) (specdec.core.speedup.parallel_speedup; in brackets with the "
             "measured h).", "",
             "| mode | k | sequential tok/s | parallel tok/s | par / seq | × svc-none seq | "
             "× svc-none par | hit rate (model) | draft ms seq → par | hidden ms/hit | "
             "round ms seq → par | speed-up predicted par |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in par:
        q = seq.get((s["mode"], s["k"]))
        row = next((r for r in (models.get(s["mode"]) or {}).get("parallel_rows", [])
                    if r["k"] == s["k"]), {})
        b = s["breakdown"]
        qb = q["breakdown"] if q else None
        lines.append(
            f"| {s['mode']} | {s['k']} | {_f(q['tps_median'], '.1f') if q else '–'} | "
            f"{_f(s['tps_median'], '.1f')} | {_f(s['tps_median'] / q['tps_median']) if q else '–'} | "
            f"{_f(q['vs_svc_none']) if q else '–'} | {_f(s['vs_svc_none'])} | "
            f"{_f(s.get('pre_draft_hit_rate'))} ({_f(row.get('hit_rate_predicted', math.nan))}) | "
            f"{_f(qb['draft_ms']['median'], '.1f') if qb else '–'} → {_f(b['draft_ms']['median'], '.1f')} | "
            f"{_f(s.get('draft_hidden_ms_per_hit', math.nan), '.1f')} | "
            f"{_f(qb['total_ms']['median'], '.1f') if qb else '–'} → {_f(b['total_ms']['median'], '.1f')} | "
            f"{_f(row.get('speedup_predicted', math.nan))} "
            f"({_f(row.get('speedup_predicted_measured_hits', math.nan))}) |")
    return lines


SPEED_COLUMNS = ("target passes/token", "tokens/s (min–max)", "× svc-none")


def _phase_table(title: str, note: str, columns: tuple[str, ...]) -> list[str]:
    """A section's heading, note and table header (one column per name)."""
    return ["", f"## {title}", "", note, "", "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns)]


def _passes_and_speed(s: dict) -> str:
    """The SPEED_COLUMNS cells of one summary."""
    return (f"{_f(s['passes_per_token'], '.3f')} | {_f(s['tps_median'], '.1f')} "
            f"({_f(s['tps_min'], '.1f')}–{_f(s['tps_max'], '.1f')}) | {_f(s['vs_svc_none'])}")


def _prediction_section(summaries: list[dict]) -> list[str]:
    """The predicted-output cell: target passes per token with and without a prediction."""
    cells = [s for s in summaries if s["phase"] == "prediction"]
    if not cells:
        return []
    lines = _phase_table(
        "Predicted Outputs (greedy, edit prompts)",
        "The same requests without a prediction (svc-none), with the edited text as the "
        "prediction (source: what an editor sends) and with the target-only answer itself "
        "(exact: a correct prediction); the text is the same in all three (greedy identity "
        "above). accepted / rejected = prediction tokens the target accepted / rejected.",
        ("config", *SPEED_COLUMNS, "accepted", "rejected"))
    for s in cells:
        lines.append(
            f"| {s['config']} | {_passes_and_speed(s)} | "
            f"{s.get('accepted_tokens', 0)} | {s.get('drafted_tokens', 0) - s.get('accepted_tokens', 0)} |")
    return lines


def _structured_section(summaries: list[dict]) -> list[str]:
    """The structured-output cell: validity, identity and target passes per token, per config."""
    cells = [s for s in summaries if s["phase"] == "structured"]
    if not cells:
        return []
    lines = _phase_table(
        "Structured output (greedy, JSON Schema / regex pairs)",
        "Each request constrained by its pair's grammar (benchmarks/prompts/structured-v1.jsonl): "
        "constrained target-only (svc-none), then the same request with the draft at k = 4 and "
        "with the orchestrator's default proposer (svc-default). valid = outputs that parse and "
        "validate against their schema (or match their regex); identical = outputs token for "
        "token equal to constrained target-only (rep 0); both out of all requests "
        "(pairs × repetitions).",
        ("config", "valid", "identical", *SPEED_COLUMNS))
    for s in cells:
        lines.append(f"| {s['config']} | {s.get('valid', 0)}/{s['requests']} | "
                     f"{s.get('identical', 0)}/{s['requests']} | {_passes_and_speed(s)} |")
    return lines


def _category_section(result: dict) -> list[str]:
    """× svc-none and × hf-target per prompt category: where each proposer wins or loses."""
    rows = result.get("by_category") or []
    if not rows:
        return []
    categories = sorted({r["category"] for r in rows})
    lines = ["", "## By prompt category"]
    for key, base in (("vs_svc_none", "svc-none"), ("vs_hf_target", "hf-target")):
        index = {(r["mode"], r["config"], r["category"]): r.get(key, math.nan) for r in rows}
        if all(math.isnan(v) for v in index.values()):
            continue
        lines += ["", f"× {base} within each category (tokens/s: median over repetitions of tokens / "
                  "seconds summed over the category's prompts); the last column is the lowest.", "",
                  "| mode | config | " + " | ".join(categories) + " | min |",
                  "|---|---|" + "---|" * (len(categories) + 1)]
        for mode, config in dict.fromkeys((r["mode"], r["config"]) for r in rows):
            if config == base:
                continue
            values = [index.get((mode, config, c), math.nan) for c in categories]
            lines.append(f"| {mode} | {config} | " + " | ".join(_f(v) for v in values)
                         + f" | {_f(min(values))} |")
    return lines


def render(result: dict, out_dir: Path) -> None:
    """Write plots and results.md into `out_dir` (the JSON's own folder by default)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result["plots"] = plots(result, out_dir)
    (out_dir / "results.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path, help="results.json written by benchmarks.run")
    parser.add_argument("--out", type=Path, default=None, help="folder (default: the JSON's)")
    args = parser.parse_args(argv)
    result = json.loads(args.results.read_text())
    result.update(analysis.analyse(result["records"]))  # recomputed: the JSON stores NaN as null
    render(result, args.out or args.results.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Summaries, the greedy identity check, the goal table, Markdown and PNGs for benchmarks.load.

Re-render a saved run: `python -m benchmarks.load.report path/to/results.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks.load import profile as load_profile

PLOTS = ("tps_vs_n.png", "ttft_vs_n.png")
SERVICE_MODES = ("batched", "unbatched")


def _pct(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of values, or None."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def json_safe(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------------- identity


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_mismatches(records: list[dict], reference: dict[str, list[int]]) -> list[dict]:
    """Every service stream whose tokens differ from target-only alone on its prompt."""
    bad = []
    for r in records:
        if r["mode"] not in SERVICE_MODES:
            continue
        for i, s in enumerate(r["streams"]):
            diff = first_difference(s["token_ids"], reference.get(s["prompt_id"], []))
            if diff is not None:
                bad.append({"mode": r["mode"], "config": r["config"], "n": r["n"], "rep": r["rep"], "stream": i,
                            "prompt_id": s["prompt_id"], "first_difference": diff})
    return bad


def identity(records: list[dict], reference: dict[str, list[int]]) -> dict:
    compared = sum(len(r["streams"]) for r in records if r["mode"] in SERVICE_MODES)
    bad = identity_mismatches(records, reference)
    peer = [(s["prompt_id"], r["config"], r["n"], first_difference(s["token_ids"], reference.get(s["prompt_id"], [])))
            for r in records if r["mode"] == "peer" for s in r["streams"]]
    return {"compared": compared, "mismatches": bad, "passed": not bad and compared > 0,
            "peer_compared": len(peer),
            "peer_differ": [{"prompt_id": p, "config": c, "n": n, "first_difference": d}
                            for p, c, n, d in peer if d is not None]}


# ---------------------------------------------------------------------------- summaries


def _itl(stream: dict) -> list[float]:
    """Inter-token latency, ms, per token after the first: a chunk's gap spread over its tokens."""
    out, prev = [], None
    for t, n in stream["chunks"]:
        if prev is not None and n:
            out += [(t - prev) * 1e3 / n] * n
        elif prev is None and n > 1:
            out += [0.0] * (n - 1)  # tokens arriving with the first one
        prev = t
    return out


def _batches(records: list[dict]) -> dict:
    """Per role and metric: forwards and mean over all of a cell's repetitions, buckets summed."""
    out: dict[str, dict] = {}
    for r in records:
        for role, metrics in (r.get("batches") or {}).items():
            for name, h in metrics.items():
                acc = out.setdefault(role, {}).setdefault(name, {"forwards": 0.0, "total": 0.0, "buckets": {}})
                if h.get("forwards") and h.get("mean") is not None:
                    acc["forwards"] += h["forwards"]
                    acc["total"] += h["mean"] * h["forwards"]
                for le, v in h.get("buckets", {}).items():
                    acc["buckets"][le] = acc["buckets"].get(le, 0.0) + v
    for metrics in out.values():
        for h in metrics.values():
            h["mean"] = h.pop("total") / h["forwards"] if h["forwards"] else None
    return out


def forward_ms(limit: dict[int, dict], n: int) -> float | None:
    """The in-process cost of one forward over n one-token rows, interpolated linearly between the
    row counts measured (benchmarks.load.limit_sizes), extrapolated from the last two past them.

    The measured costs are first made non-decreasing from the top (a forward over fewer rows
    costs at most what one over more rows was measured at: it could have carried them), so a
    noisy measurement at some row count never loosens the limit."""
    points = sorted((int(k), v["forward_ms"]) for k, v in limit.items() if v.get("forward_ms"))
    if not points or n < 1:
        return None
    for i in range(len(points) - 2, -1, -1):
        points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
    for (n0, f0), (n1, f1) in zip(points, points[1:]):
        if n0 <= n <= n1:
            return f0 + (f1 - f0) * (n - n0) / (n1 - n0)
    if n <= points[0][0]:
        return points[0][1]
    if len(points) == 1:
        return points[0][1] * n / points[0][0]
    (n0, f0), (n1, f1) = points[-2:]
    return f1 + (f1 - f0) * (n - n1) / (n1 - n0)


def decode_phase(record: dict, limit: dict[int, dict]) -> dict | None:
    """The cell's decode phase: from the moment every stream had its first token (all prompts
    prefilled) to the last stream's end.

    Its tokens are those streamed after that moment; `tps` is their rate. The physical limit of
    the same work: with every forward carrying every stream still running, step j has n_j rows
    (the streams with at least j tokens left) and costs forward_ms(n_j); `limit_tps` is the
    tokens over the sum of those costs, and `efficiency` = tps / limit_tps (one token per stream
    and step: target-only's rounds). `ideal_rows` is the mean n_j, what a full batch can hold
    once streams end at different lengths; `rows` is the target's measured rows per forward
    over the phase (its histograms scraped at the phase's start and at the cell's end)."""
    start = (record.get("decode") or {}).get("start_s")
    streams = record.get("streams") or []
    if start is None or not streams:
        return None
    # The curve measured once, scaled to the cell's own row count measured next to it: with its
    # sessions holding their prompts and half the generated tokens (decode_limit_ms, the phase's
    # mean context), else their prompts only (limit_ms, runs before it was measured).
    scale = 1.0
    base = forward_ms(limit, record["n"]) if limit else None
    measured = record.get("decode_limit_ms") or record.get("limit_ms")
    if measured and base:
        scale = measured / base
    left = [sum(n for t, n in s["chunks"] if t > start) for s in streams]
    span = max(s["end_s"] for s in streams) - start
    tokens = sum(left)
    if tokens <= 0 or span <= 0:
        return None
    steps = [sum(1 for r in left if r >= j) for j in range(1, max(left) + 1)]
    costs = [forward_ms(limit, n) for n in steps]
    ideal_s = scale * sum(costs) / 1e3 if limit and all(c is not None for c in costs) else None
    rows = (record["decode"].get("batches") or {}).get("target", {}).get("batch_rows", {}).get("mean")
    out = {"tokens": tokens, "span_s": span, "tps": tokens / span, "ideal_rows": tokens / len(steps),
           "rows": rows, "limit_tps": tokens / ideal_s if ideal_s else None}
    out["efficiency"] = out["tps"] / out["limit_tps"] if out["limit_tps"] else None
    return out


ROUND_PARTS = ("round", "draft", "target", "serialize", "network", "orchestrator", "redis")


def round_parts(streams: list[dict]) -> dict[str, float] | None:
    """Medians over every round after the first of a cell's streams, ms, per part of a round
    (Stats.rounds: the round's wall time in the orchestrator; the draft's and the target's
    server-side time, queueing in the service included; serialization; the rest of the RPCs
    (network: gRPC, the wire, and the batch call's gathering); the orchestrator's own work;
    Redis)."""
    rows = [r for s in streams for r in s.get("round_ms") or ()]
    if not rows:
        return None
    return {name: statistics.median(r[i] for r in rows) for i, name in enumerate(ROUND_PARTS)}


def summarize(records: list[dict], limit: dict[int, dict] | None = None) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["mode"], r["config"], r["n"]), []).append(r)
    out = []
    for (mode, config, n), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        agg, rounds_ps, rpcs_per_token = [], [], []
        per_stream, ttft, itl, ks = [], [], [], []
        decodes, parts = [], []
        by_rep: dict[int, float] = {}
        for r in rs:
            streams = r["streams"]
            phase = decode_phase(r, limit or {})
            if phase is not None:
                decodes.append(phase)
            part = round_parts(streams)
            if part is not None:
                parts.append(part)
            tokens = sum(len(s["token_ids"]) for s in streams)
            span = max((s["end_s"] for s in streams), default=0.0)
            agg.append(tokens / span if span > 0 else 0.0)
            by_rep[r.get("rep", len(by_rep))] = agg[-1]
            rounds = sum(s.get("rounds", 0) for s in streams)
            if span > 0 and rounds:
                rounds_ps.append(rounds / span)
            rpcs = sum(m.get("rpcs", {}).get("forwards") or 0.0 for m in (r.get("batches") or {}).values())
            if tokens and rpcs:
                rpcs_per_token.append(rpcs / tokens)
            per_stream += [len(s["token_ids"]) / s["end_s"] for s in streams if s["end_s"] > 0]
            ttft += [s["ttft_s"] * 1e3 for s in streams]
            for s in streams:
                itl += _itl(s)
                ks += s.get("rounds_k", [])
        out.append({
            "mode": mode, "config": config, "n": n, "reps": len(rs),
            "agg_tps": statistics.median(agg), "agg_tps_all": agg, "agg_tps_by_rep": by_rep,
            "stream_tps_median": statistics.median(per_stream) if per_stream else None,
            "stream_tps_min": min(per_stream) if per_stream else None,
            "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
            "itl_p50_ms": _pct(itl, 0.5), "itl_p99_ms": _pct(itl, 0.99),
            "rounds_per_s": statistics.median(rounds_ps) if rounds_ps else None,
            "rpcs_per_token": statistics.median(rpcs_per_token) if rpcs_per_token else None,
            "k_mean": statistics.fmean(ks) if ks else None,
            "k0_share": sum(k == 0 for k in ks) / len(ks) if ks else None,
            "batches": _batches(rs),
            "decode": _median_rep(decodes),
            # N over the forward over N rows measured next to each of the cell's repetitions.
            "cell_limit_tps": statistics.median(n / r["limit_ms"] * 1e3 for r in rs if r.get("limit_ms"))
            if any(r.get("limit_ms") for r in rs) else None,
            "round_parts": _median_phase(parts),
            "cpu_us": _median_phase([r["cpu_us"] for r in rs if r.get("cpu_us")]),
            "profile": _median_phase([r["profile"] for r in rs if r.get("profile")]),
        })
    return out


def _median_phase(phases: list[dict]) -> dict | None:
    """Per figure of decode_phase, the median over a cell's repetitions (None where unmeasured)."""
    if not phases:
        return None
    out = {}
    for key in phases[0]:
        values = [p[key] for p in phases if p.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _median_rep(phases: list[dict], key: str = "efficiency") -> dict | None:
    """The decode phase of the repetition whose `key` is the median (the lower one of an even
    count), so its figures belong together: per-figure medians had printed an efficiency of 0.85
    beside 128.5 of 186.9 tok/s, the tokens/s and the limit of two other repetitions. Without
    the key measured anywhere, the per-figure medians."""
    ranked = sorted((p for p in phases if p.get(key) is not None), key=lambda p: p[key])
    if not ranked:
        return _median_phase(phases)
    return ranked[(len(ranked) - 1) // 2]


def _cell(summaries: list[dict], mode: str, config: str, n: int) -> dict | None:
    return next((s for s in summaries if (s["mode"], s["config"], s["n"]) == (mode, config, n)), None)


def rep_ratios(summaries: list[dict], config: str, n: int, base: str = "target-only") -> list[float]:
    """config / base aggregate tokens/s per repetition (the two cells of a repetition ran side by
    side, interleaved), in repetition order: how a median ratio spreads."""
    a = (_cell(summaries, "batched", config, n) or {}).get("agg_tps_by_rep") or {}
    b = (_cell(summaries, "batched", base, n) or {}).get("agg_tps_by_rep") or {}
    return [a[rep] / b[rep] for rep in sorted(a) if rep in b and b[rep] > 0]


def _by_rep(summaries: list[dict], config: str, n: int) -> str:
    """ " (by repetition 0.91 0.93 0.82; target-only's own spread 29%)" for two or more repetitions."""
    ratios = rep_ratios(summaries, config, n)
    own = list(((_cell(summaries, "batched", "target-only", n) or {}).get("agg_tps_by_rep") or {}).values())
    if len(ratios) < 2:
        return ""
    spread = f"; target-only's own spread {max(own) / min(own) - 1:.0%}" if own and min(own) > 0 else ""
    return f" (by repetition {' '.join(f'{r:.2f}' for r in ratios)}{spread})"


def goals(summaries: list[dict], ident: dict, settings: dict) -> list[dict]:
    """The issue's goal table: figure, value, target, met."""
    out = []

    def add(figure: str, value, target: str, met: bool | None, note: str = "") -> None:
        out.append({"figure": figure, "value": value, "target": target, "met": met, "note": note})

    def tps(mode: str, config: str, n: int) -> float | None:
        c = _cell(summaries, mode, config, n)
        return c["agg_tps"] if c else None

    ns = settings.get("ns", [])
    limit = {int(n): v for n, v in (settings.get("physical_limit") or {}).items()}
    for n in (8, 16):
        cell = _cell(summaries, "batched", "target-only", n) or {}
        v, lim = tps("batched", "target-only", n), cell.get("cell_limit_tps") or limit.get(n, {}).get("limit_tps")
        ratio = v / lim if v and lim else None
        add(f"target-only aggregate tokens/s at N={n} / physical limit (whole cell, prefill included)",
            ratio, ">= 0.85", None if ratio is None else ratio >= 0.85,
            f"{v:.1f} of {lim:.1f} tok/s" if ratio is not None else "")
    for n in (8, 16):
        phase = (_cell(summaries, "batched", "target-only", n) or {}).get("decode") or {}
        eff = phase.get("efficiency")
        add(f"target-only decode phase at N={n} / physical limit of the same streams", eff, ">= 0.85",
            None if eff is None else eff >= 0.85,
            f"{phase['tps']:.1f} of {phase['limit_tps']:.1f} tok/s" if eff is not None else "")
    c16 = _cell(summaries, "batched", "target-only", 16)
    rows16 = (c16 or {}).get("batches", {}).get("target", {}).get("batch_rows", {}).get("mean")
    add("target rows per forward at N=16, target-only (whole cell, prefill chunks included)", rows16, ">= 13",
        None if rows16 is None else rows16 >= 13)
    phase16 = (c16 or {}).get("decode") or {}
    if phase16.get("rows") is not None:
        add("target rows per forward at N=16, target-only, decode phase", phase16["rows"], ">= 13",
            phase16["rows"] >= 13, f"a full batch of the streams still running: {phase16['ideal_rows']:.2f}")
    for config in ("default", "adaptive"):
        pairs = [(n, tps("batched", config, n), tps("batched", "target-only", n)) for n in ns]
        pairs = [(n, a / t) for n, a, t in pairs if a and t]
        if pairs:
            worst = min(r for _, r in pairs)
            add(f"{config} / target-only aggregate tokens/s, every N", worst, ">= 1.0 at every N",
                worst >= 1.0, ", ".join(f"N={n}: {r:.2f}{_by_rep(summaries, config, n)}" for n, r in pairs))
    if settings.get("tiny") and 64 in ns:
        c64 = _cell(summaries, "batched", "target-only", 64)
        rps = (c64 or {}).get("rounds_per_s")
        add("tiny models: target-only rounds/s in all at N=64", rps, ">= 2000",
            None if rps is None else rps >= 2000)
    for n in (1, 64):  # the control plane at GPU speed: its share of the physical limit
        cell = _cell(summaries, "batched", "target-only", n) or {}
        v, lim = cell.get("agg_tps"), cell.get("cell_limit_tps") or limit.get(n, {}).get("limit_tps")
        if v and lim:
            add(f"target-only at N={n} / physical limit (control plane's share)", v / lim, ">= 0.50",
                v / lim >= 0.50, f"{v:.1f} of {lim:.1f} tok/s")
    cpu64 = ((_cell(summaries, "batched", "target-only", 64) or {}).get("cpu_us") or {}).get("orchestrator")
    if cpu64 is not None:
        add("orchestrator CPU per stream-round at N=64, target-only (µs)", cpu64, "<= 30", cpu64 <= 30)
    pairs = [(n, tps("batched", "target-only", n), tps("peer", "hf-padded", n)) for n in ns]
    pairs = [(n, a / p) for n, a, p in pairs if a and p]
    if pairs:
        worst = min(r for _, r in pairs)
        add("batched target-only / in-process padded generate, every N", worst, ">= 1.0 at every N",
            worst >= 1.0, ", ".join(f"N={n}: {r:.2f}" for n, r in pairs))
    share = (ident["compared"] - len(ident["mismatches"])) / ident["compared"] if ident["compared"] else None
    add("greedy identity (every stream = target-only alone)", share, "100%", ident["passed"],
        f"{ident['compared']} streams compared")
    return out


def build(records: list[dict], reference: dict[str, list[int]], settings: dict, environment: dict) -> dict:
    limit = {int(n): v for n, v in (settings.get("physical_limit") or {}).items()}
    summaries = summarize(records, limit)
    ident = identity(records, reference)
    return {"environment": environment, "settings": settings, "reference": reference, "records": records,
            "summaries": summaries, "identity": ident, "goals": goals(summaries, ident, settings)}


# ---------------------------------------------------------------------------- Markdown and plots


def _f(x, fmt: str = ".1f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _met(m) -> str:
    return "–" if m is None else ("met" if m else "**missed**")


def markdown(result: dict) -> str:
    lines = _header(result) + _goals_section(result["goals"]) + _identity_section(result["identity"])
    lines += _cells_section(result) + _round_parts_section(result["summaries"]) + _cpu_section(result["summaries"])
    lines += _profile_section(result["summaries"]) + NOTES
    return "\n".join(lines)


def _header(result: dict) -> list[str]:
    """The title and what ran where: command, models, machine, streams, stacks."""
    env, cfg = result["environment"], result["settings"]
    return [
        f"# specdec load benchmark ({'quick' if cfg.get('quick') else 'full'})", "",
        f"- command: `{cfg.get('command', '')}`",
        f"- target: {env.get('target_model')}; draft: {env.get('draft_model')}; "
        f"{cfg.get('threads')} torch thread per process (target and draft one each)",
        f"- CPU: {env.get('cpu')} ({env.get('cpu_count')} cores, shared); torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}; git {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}",
        f"- N = {cfg.get('ns')} concurrent greedy streams (suite prompts, all started at once), "
        f"{cfg.get('max_new_tokens')} new tokens"
        f"{' (ignore_eos: every stream that long)' if cfg.get('ignore_eos') else ''}, "
        f"{cfg.get('reps')} repetition(s), cells interleaved per N"
        + (f"; --stream-interval {cfg['stream_interval']} (a chunk message every "
           f"{cfg['stream_interval']} tokens)" if cfg.get("stream_interval", 1) > 1 else "")
        + ("; --multiplex (each cell's streams over one GenerateMany stream)" if cfg.get("multiplex") else ""),
        f"- stacks: {', '.join(cfg.get('modes', []))}"
        + ("" if cfg.get("batching_flag") else " — **the services have no --max-batch flag in this build: "
           "they run one request per forward; no unbatched stack was started**"),
        "",
    ]


def _goals_section(goals: list[dict]) -> list[str]:
    """The goal table: figure, value, target, met or missed."""
    lines = ["## Goals", "", "| figure | value | target | |", "|---|---|---|---|"]
    for g in goals:
        value = g["value"]
        shown = _f(value * 100, ".0f") + "%" if "identity" in g["figure"] and value is not None else _f(value, ".2f")
        lines.append(f"| {g['figure']} | {shown}{' (' + g['note'] + ')' if g['note'] else ''} | {g['target']} "
                     f"| {_met(g['met'])} |")
    return lines


def _identity_section(ident: dict) -> list[str]:
    """Every service stream against target-only alone, then the in-process peer (informative)."""
    lines = ["", "## Greedy identity", ""]
    if ident["mismatches"]:
        lines.append(f"**FAILED**: {len(ident['mismatches'])} of {ident['compared']} streams differ from "
                     "target-only alone:")
        lines += [f"- {m['prompt_id']} {m['mode']} {m['config']} N={m['n']} rep {m['rep']}: first difference "
                  f"at token {m['first_difference']}" for m in ident["mismatches"][:50]]
    else:
        lines.append(f"PASSED: all {ident['compared']} streams (both stacks, every configuration and N) equal "
                     "target-only alone, token for token.")
    lines += ["", f"In-process peer vs target-only alone: {len(ident['peer_differ'])} of "
              f"{ident['peer_compared']} greedy outputs differ"
              + (" (" + ", ".join(f"{d['config']} N={d['n']} {d['prompt_id']}@{d['first_difference']}"
                                  for d in ident["peer_differ"][:12]) + ")" if ident["peer_differ"] else "")
              + " (padding changes the peer's kernel shapes; informative, not part of the check).", ""]
    return lines


def _cells_section(result: dict) -> list[str]:
    """One row per (stack, configuration, N): throughput, the limit, latency, batches, k."""
    lines = ["## Cells", "",
             "Aggregate tokens/s = all streams' tokens / (first start to last end), median over repetitions. "
             "TTFT and inter-token latency (ITL: a chunk's gap spread over its tokens) pooled over streams. "
             "Batches: the services' histograms over the cell (forwards, mean rows and tokens per forward). "
             "Physical limit: N tokens over the cost of one in-process forward over N one-token rows (the "
             "engine, the same weights, one thread), measured next to each target-only cell (the machine's "
             "speed drifts), else once at the start. RPCs / token: Score, ScoreBatch, Propose and ProposeBatch "
             "calls the services served, per token streamed. "
             "k: the k the adaptive rounds used (mean, share of rounds at k = 0).", "",
             "Decode phase: from the moment every stream had its first token to the last one's end "
             "(load_report.decode_phase): its tokens/s, against the physical limit of the same streams "
             "(every forward carrying every stream still running, its sessions holding their prompts and "
             "half the tokens a stream generates: the phase's mean context), and the target's rows per forward "
             "then, against what a full batch of the running streams holds.", "",
             "| stack | config | N | agg tok/s | physical limit | decode tok/s / limit | decode rows / full "
             "| rounds/s | RPCs / token | stream tok/s med / min "
             "| TTFT p50 / p99 ms | ITL p50 / p99 ms "
             "| target rows / tokens per forward | draft rows per forward | k mean (k=0) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    limit = {int(n): v for n, v in (result["settings"].get("physical_limit") or {}).items()}
    for s in result["summaries"]:
        b = s.get("batches") or {}
        t_rows = b.get("target", {}).get("batch_rows", {}).get("mean")
        t_tok = b.get("target", {}).get("batch_tokens", {}).get("mean")
        d_rows = b.get("draft", {}).get("batch_rows", {}).get("mean")
        k = f"{_f(s['k_mean'], '.2f')} ({_f(s['k0_share'] * 100, '.0f')}%)" if s["k_mean"] is not None \
            and s["config"] == "adaptive" else "–"
        lim = (s.get("cell_limit_tps") or limit.get(s["n"], {}).get("limit_tps")) if s["mode"] == "batched" else None
        d = s.get("decode") or {}
        lines.append(
            f"| {s['mode']} | {s['config']} | {s['n']} | {_f(s['agg_tps'])} | {_f(lim)} | "
            f"{_f(d.get('tps'))} / {_f(d.get('limit_tps'))} | {_f(d.get('rows'), '.2f')} / "
            f"{_f(d.get('ideal_rows'), '.2f')} | "
            f"{_f(s.get('rounds_per_s'), '.0f')} | {_f(s.get('rpcs_per_token'), '.2f')} | "
            f"{_f(s['stream_tps_median'])} / "
            f"{_f(s['stream_tps_min'])} | {_f(s['ttft_p50_ms'], '.0f')} / {_f(s['ttft_p99_ms'], '.0f')} | "
            f"{_f(s['itl_p50_ms'], '.0f')} / {_f(s['itl_p99_ms'], '.0f')} | {_f(t_rows, '.2f')} / {_f(t_tok, '.1f')} "
            f"| {_f(d_rows, '.2f')} | {k} |")
    return lines


CPU_PARTS = ("orchestrator", "target", "draft", "client", "target_forward", "draft_forward")


def _cpu_section(summaries: list[dict]) -> list[str]:
    """Each process's CPU time per stream-round (bench.cpu_per_stream_round)."""
    rows = [s for s in summaries if s.get("cpu_us")]
    if not rows:
        return []
    lines = ["", "CPU time per stream-round (µs; a stream-round is one stream's round, so a batched round of "
             "N streams counts N): the orchestrator that served the cell, each model service outside its "
             "forward passes (its control plane: gRPC, decoding, scheduling, sampling), the client streaming "
             "every stream (this benchmark's process), and the forward passes' own time per stream-round "
             "for comparison. Redis: the commands its server ran per stream-round over the cell (every "
             "orchestrator's, with --orchestrator-workers), while the run had that server to itself.", "",
             "| stack | config | N | orchestrator | target outside forward | draft outside forward | client "
             "| target forward | draft forward | Redis commands |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        c = s["cpu_us"]
        lines.append(f"| {s['mode']} | {s['config']} | {s['n']} | "
                     + " | ".join(_f(c.get(name), ".0f") for name in CPU_PARTS)
                     + f" | {_f(c.get('redis_commands'), '.2f')} |")
    return lines


def _profile_section(summaries: list[dict]) -> list[str]:
    """--profile: the parts of the orchestrator's busy CPU samples (benchmarks.load.profile)."""
    rows = [s for s in summaries if s.get("profile")]
    if not rows:
        return []
    names = [part for part in load_profile.ORDER if part != "waiting"]
    lines = ["", "Where the orchestrator's CPU goes (--profile: py-spy samples during each cell, "
             "each sample in the part of its innermost frame that a rule names; shares of the busy samples, "
             "medians over repetitions; benchmarks.load.profile's docstring defines the parts).", "",
             "| stack | config | N | samples | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for s in rows:
        lines.append(f"| {s['mode']} | {s['config']} | {s['n']} | {_f(s['profile'].get('samples'), '.0f')} | "
                     + " | ".join(load_profile.table(s["profile"])) + " |")
    return lines


def _round_parts_section(summaries: list[dict]) -> list[str]:
    """Where a round's time goes, per cell with rounds (round_parts)."""
    lines = ["", "Where a round's time goes (ms, medians over every round after the first; "
             "load_report.round_parts): the round's wall time in the orchestrator, the services' own time "
             "(queueing there included), serialization, the rest of the RPCs (gRPC, the wire, a batch "
             "call's gathering), the orchestrator's own work, Redis.", "",
             "| stack | config | N | round | draft | target | serialize | network | orchestrator | redis |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        p = s.get("round_parts")
        if p:
            lines.append(f"| {s['mode']} | {s['config']} | {s['n']} | "
                         + " | ".join(_f(p.get(name)) for name in ROUND_PARTS) + " |")
    return lines


NOTES = ["", "Notes:", "",
         "- All N streams start at the same instant, so their prefills land together: on a CPU a forward "
         "over N prompts costs about N prompts' compute, and TTFT grows with N whatever the batching.",
         "- hf-assisted-k4 is `generate(assistant_model=)` at batch 1: it serves one request at a time, "
         "measured at the smallest N only.",
         "- The machine's cores are shared with other work; compare ratios within this run.", ""]


def plots(result: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, dict]]] = {}
    for s in result["summaries"]:
        series.setdefault(f"{s['mode']}: {s['config']}", []).append((s["n"], s))
    for name, key, ylabel in (("tps_vs_n.png", "agg_tps", "aggregate tokens/s"),
                              ("ttft_vs_n.png", "ttft_p50_ms", "TTFT p50 (ms)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for label, points in sorted(series.items()):
            points = sorted((n, s[key]) for n, s in points if s[key] is not None)
            if not points:
                continue
            style = "-" if label.startswith("batched") else ("--" if label.startswith("unbatched") else ":")
            ax.plot([n for n, _ in points], [v for _, v in points], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams N")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} vs N")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)


def render(result: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    (out_dir / "results.md").write_text(markdown(result))
    plots(result, out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load.report")
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, help="default: the results file's folder")
    p.add_argument("--rebuild", action="store_true",
                   help="recompute the summaries and the goal table from the stored records "
                        "(after a change to this report), and write results.json again")
    args = p.parse_args(argv)
    result = json.loads(args.results.read_text())
    out = args.out or args.results.parent
    if args.rebuild:
        result = build(result["records"], result["reference"], result["settings"], result["environment"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(json_safe(result)))
    render(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

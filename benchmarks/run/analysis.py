"""Turn raw benchmark records into the figures the report shows.

Pure functions over plain dicts (the records stored in the JSON output), so a
saved run can be re-analysed: `python -m benchmarks.run.report results.json`.

A record is one request: keys `phase` ("main", "rtt", "rate"), `mode`
("greedy", "sampling"), `config` (e.g. "svc-draft-k4", "hf-target"), `family`
("svc" / "hf"), `proposer`, `k`, `rtt_ms`, `rate_mbps`, `prompt_id`, `rep`,
`new_tokens`, `wall_s`, `ttft_s`, `token_ids`, `target_passes`,
`draft_passes`, and for "svc" records `stats` (the orchestrator's Stats,
`stats["rounds"]` a list of per-round dicts). Records saved before Stats had
rounds still analyse: the breakdown then falls back to per-request averages.

"svc-draft-auto" (proposer "draft", k 0) is adaptive k: the orchestrator picks
k each round, so it has no closed-form prediction; its summary carries the k
it actually used per round (`k_mean`, `k_min`, `k_max` over Stats.rounds).

"svc-draft-par-k{K}" (record key `parallel`) is parallel speculation: rounds
served by a pre-draft (Stats.Round.pre_drafted) made no draft call of their
own; their pre-draft's compute is Round.draft_hidden_ms, outside the round.
Its prediction is specdec.core.speedup.parallel_speedup with the measured hit
rate next to the modelled alpha^(k+1).

Phase "structured" (the structured-output cell) records carry `pair_id`,
`constraint` ("json_schema" / "regex") and `valid` (the text matches the pair's
schema or regex); its summaries add `valid`, `identical` (tokens equal to the
cell's own constrained target-only, svc-none rep 0) and `pairs`.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable

from orchestrator.proposers.registry import names
from specdec.core.speedup import expected_tokens_per_pass, parallel_speedup, pre_draft_hit_rate

# Stats.Round fields that make up a round, in the order the stacked bars show
# them; they sum to the round's total_ms.
COMPONENTS = ("draft_ms", "target_ms", "serialize_ms", "network_ms", "orchestrator_ms", "redis_ms")
COMPUTE = ("draft_ms", "target_ms")


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile; NaN for an empty list."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def key_of(rec: dict) -> tuple:
    """(phase, mode, rtt_ms, rate_mbps, config): one cell of the result grid."""
    return (rec["phase"], rec["mode"], rec.get("rtt_ms"), rec.get("rate_mbps"), rec["config"])


def group(records: Iterable[dict]) -> dict[tuple, list[dict]]:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for rec in records:
        cells[key_of(rec)].append(rec)
    return dict(cells)


def is_adaptive(cell: dict) -> bool:
    """A record or summary of svc-draft-auto: draft through the services with k = 0."""
    return cell.get("family") == "svc" and cell.get("proposer") == "draft" and not cell.get("k")


def rounds_of(rec: dict) -> int:
    """Verify rounds (target passes) of one request, at least 1."""
    return max(1, int(rec.get("target_passes") or 0))


def rounds_drafted_accepted(rec: dict, k: int) -> list[tuple[int, int]]:
    """(drafted, accepted) per round of one request: from Stats.rounds when
    present (or Stats.drafted_per_round), else reconstructed (older records)."""
    stats = rec.get("stats", {})
    if stats.get("rounds"):
        return [(int(r.get("drafted", 0)), int(r.get("accepted", 0))) for r in stats["rounds"]]
    accepted = [int(a) for a in stats.get("accepted_per_round") or []]
    drafted = [int(d) for d in stats.get("drafted_per_round") or []]
    if len(drafted) != len(accepted):
        drafted = drafted_per_round(accepted, k, rec.get("max_new_tokens") or 10**9)
    return list(zip(drafted, accepted))


def drafted_per_round(accepted_per_round: list[int], k: int, max_new_tokens: int) -> list[int]:
    """How many tokens each round drafted, as the orchestrator chose it (for
    records without Stats.rounds / drafted_per_round).

    Such records carry accepted counts per round only; the draft k of a round is
    min(k, remaining - 1) (the round's extra token fills the last slot), and
    a round commits accepted + 1 tokens. Assumes the draft service always
    returns the k it was asked for.
    """
    out, generated = [], 0
    for a in accepted_per_round:
        out.append(max(0, min(k, max_new_tokens - generated - 1)))
        generated += int(a) + 1
    return out


def per_position_acceptance(records: list[dict], k: int) -> tuple[list[float], int, int]:
    """Conditional acceptance per draft position from the rounds' drafted/accepted counts.

    Entry i is P(draft token i+1 accepted | tokens 1..i accepted), over the
    rounds that drafted position i+1. Returns (rates, accepted, trials);
    accepted / trials is the maximum-likelihood alpha of the i.i.d. model
    behind (1 - a^(k+1)) / (1 - a).
    """
    reached = [0] * k
    passed = [0] * k
    for rec in records:
        for d, a in rounds_drafted_accepted(rec, k):
            d = min(d, k)
            for i in range(min(a + 1, d)):  # positions 1..a accepted, a+1 tried (if drafted)
                reached[i] += 1
            for i in range(min(a, d)):
                passed[i] += 1
    rates = [p / r if r else math.nan for p, r in zip(passed, reached)]
    return rates, sum(passed), sum(reached)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a) from specdec.core.speedup; NaN when alpha is unknown."""
    if alpha is None or math.isnan(alpha):
        return math.nan
    return expected_tokens_per_pass(alpha, k)


def summarize_cell(records: list[dict]) -> dict:
    """tokens/s per repetition (sum of tokens / sum of seconds over prompts),
    passes per token, accepted length, TTFT, and the per-round breakdown."""
    by_rep: dict[int, list[dict]] = defaultdict(list)
    for rec in records:
        by_rep[rec["rep"]].append(rec)
    tps = [
        sum(r["new_tokens"] for r in rs) / max(1e-9, sum(r["wall_s"] for r in rs))
        for _, rs in sorted(by_rep.items())
    ]
    tokens = sum(r["new_tokens"] for r in records)
    passes = sum(r.get("target_passes") or 0 for r in records)
    first = records[0]
    out: dict = {
        "config": first["config"],
        "family": first["family"],
        "proposer": first["proposer"],
        "k": first["k"],
        "parallel": bool(first.get("parallel")),
        "mode": first["mode"],
        "phase": first["phase"],
        "rtt_ms": first.get("rtt_ms"),
        "rate_mbps": first.get("rate_mbps"),
        "requests": len(records),
        "reps": len(tps),
        "tokens_per_s": tps,
        "tps_median": median(tps),
        "tps_min": min(tps) if tps else math.nan,
        "tps_max": max(tps) if tps else math.nan,
        "new_tokens": tokens,
        "target_passes": passes,
        "passes_per_token": passes / tokens if tokens else math.nan,
        "tokens_per_pass": tokens / passes if passes else math.nan,
        "ttft_ms_median": median([r["ttft_s"] * 1000 for r in records]),
        "ttft_ms_p90": quantile([r["ttft_s"] * 1000 for r in records], 0.9),
    }
    if first["family"] == "hf":
        draft_passes = sum(r.get("draft_passes") or 0 for r in records)
        out["draft_passes"] = draft_passes
        if first["proposer"] != "target" and passes:
            # Each assisted/lookup pass commits the accepted drafts + one token.
            out["mean_accepted"] = tokens / passes - 1
        return out

    stats = [r["stats"] for r in records]
    drafted = sum(s.get("drafted_tokens", 0) for s in stats)
    accepted = sum(s.get("accepted_tokens", 0) for s in stats)
    rounds = sum(len(s.get("accepted_per_round") or []) for s in stats)
    out.update(
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else math.nan,
        mean_accepted=accepted / rounds if rounds else math.nan,
        cache_misses=sum(s.get("cache_misses", 0) for s in stats),
        target_ms_per_pass=sum(s.get("target_ms", 0.0) for s in stats) / max(1, passes),
        draft_ms_per_drafted=(
            sum(s.get("draft_ms", 0.0) for s in stats) / drafted if drafted else math.nan),
        fallbacks=sorted({s.get("fallback_reason") for s in stats if s.get("fallback_reason")}),
    )
    # The k each round asked for (Stats.Round.k): the config's k, less in a
    # request's last rounds; for svc-draft-auto whatever the orchestrator chose.
    ks = [int(rd.get("k", 0)) for s in stats for rd in s.get("rounds") or []]
    if ks and first["proposer"] != "none":
        out.update(k_mean=statistics.fmean(ks), k_min=min(ks), k_max=max(ks))
    trees = [int(rd.get("drafted", 0)) for s in stats for rd in s.get("rounds") or [] if rd.get("tree")]
    if trees:  # token trees: their sizes (Stats.rounds[].drafted of the rounds that drafted a tree)
        out.update(tree_rounds=len(trees), tree_nodes_mean=statistics.fmean(trees))
    width = first["k"] or (out.get("k_max") if is_adaptive(first) else 0)
    if first["proposer"] == "draft" and width:
        rates, acc, trials = per_position_acceptance(records, width)
        out["acceptance_by_position"] = rates
        out["alpha_accepted"] = acc
        out["alpha_trials"] = trials
        out["alpha"] = acc / trials if trials else math.nan
    # Stats' own per-position figure, averaged over requests, for comparison.
    abp = [list(s.get("acceptance_by_position") or []) for s in stats]
    if any(abp):
        width = max(len(a) for a in abp)
        out["stats_acceptance_by_position"] = [
            median([a[i] for a in abp if len(a) > i]) for i in range(width)
        ]
    if out["parallel"]:
        out.update(_parallel_figures(records))
    out["breakdown"] = breakdown(records)
    return out


def _parallel_figures(records: list[dict]) -> dict:
    """Hits (rounds served by a pre-draft) per round that could have had one, and the draft's
    cost on the rounds that did call it (ms per drafted token)."""
    rounds = [rd for r in records for rd in (r["stats"].get("rounds") or [])[1:]]  # round 1 has none
    drafting = [rd for rd in rounds if rd.get("k", 0) > 0]
    hits = sum(bool(rd.get("pre_drafted")) for rd in drafting)
    called = [rd for rd in drafting if not rd.get("pre_drafted")]
    drafted = sum(rd.get("drafted", 0) for rd in called)
    return {
        "pre_draft_hits": hits,
        "pre_draft_rounds": len(drafting),
        "pre_draft_hit_rate": hits / len(drafting) if drafting else math.nan,
        "draft_hidden_ms_per_hit": (sum(rd.get("draft_hidden_ms", 0.0) for rd in drafting) / hits
                                    if hits else math.nan),
        "draft_ms_per_drafted_called": (sum(rd.get("draft_ms", 0.0) for rd in called) / drafted
                                        if drafted else math.nan),
    }


def _dist(values: list[float]) -> dict:
    mean = statistics.fmean(values) if values else math.nan
    return {"median": median(values), "p90": quantile(values, 0.9), "mean": mean}


def breakdown(records: list[dict]) -> dict:
    """Per-round milliseconds of each component, bytes each way and the share
    of a round that is not model compute: medians and p90.

    With Stats.rounds the distributions are over every round of every request
    in the cell (`per_round` True); older records only carry per-request
    totals, so a "round" there is a request's total divided by its rounds and
    the distribution is over requests.
    """
    if records and all(r["stats"].get("rounds") for r in records):
        return _breakdown_rounds(records)
    out: dict = {"per_round": False}
    for field in (*COMPONENTS, "total_ms"):
        out[field] = _dist([r["stats"].get(field, 0.0) / rounds_of(r) for r in records])
    for field in ("bytes_sent", "bytes_received", "feature_bytes"):
        out[field + "_per_round"] = _dist([r["stats"].get(field, 0) / rounds_of(r) for r in records])
    shares = []
    for r in records:
        s = r["stats"]
        total = s.get("total_ms", 0.0)
        if total > 0:
            shares.append(1 - sum(s.get(c, 0.0) for c in COMPUTE) / total)
    out["non_compute_share"] = _dist(shares)
    out["non_compute_share_pooled"] = math.nan
    return _request_level(out, records)


def _breakdown_rounds(records: list[dict]) -> dict:
    rounds = [rd for r in records for rd in r["stats"]["rounds"]]
    out: dict = {"per_round": True, "rounds": len(rounds)}
    for field in (*COMPONENTS, "total_ms", "redis_write_ms", "draft_hidden_ms"):
        out[field] = _dist([rd.get(field, 0.0) for rd in rounds])
    for field in ("bytes_sent", "bytes_received", "feature_bytes"):
        out[field + "_per_round"] = _dist([rd.get(field, 0) for rd in rounds])
    compute = [sum(rd.get(c, 0.0) for c in COMPUTE) for rd in rounds]
    totals = [rd.get("total_ms", 0.0) for rd in rounds]
    out["non_compute_share"] = _dist([1 - c / t for c, t in zip(compute, totals) if t > 0])
    # Time-weighted: the share of all round time that is not model compute.
    out["non_compute_share_pooled"] = 1 - sum(compute) / sum(totals) if sum(totals) > 0 else math.nan
    # Round 1 carries the prompt's prefill and the session set-up; shown apart.
    out["first_round_ms"] = _dist([r["stats"]["rounds"][0].get("total_ms", 0.0) for r in records])
    return _request_level(out, records)


def _request_level(out: dict, records: list[dict]) -> dict:
    """The figures that exist only per request, whichever way the rounds were read."""
    # The orchestrator's own per-round median of everything but server compute.
    over = [r["stats"]["overhead_p50_ms"] for r in records if "overhead_p50_ms" in r["stats"]]
    out["overhead_p50_ms"] = _dist(over)
    # Client wall time the orchestrator's own clock does not see (client <-> orchestrator).
    out["client_gap_ms"] = _dist([r["wall_s"] * 1000 - r["stats"].get("total_ms", 0.0) for r in records])
    return out


def summarize(records: list[dict]) -> list[dict]:
    """One summary per cell, with ratios to the baselines of the same phase/mode/link."""
    groups = group(records)
    cells = {key: summarize_cell(recs) for key, recs in groups.items()}
    _structured_counts(cells, groups)
    for (phase, mode, rtt, rate, config), s in cells.items():
        base = cells.get((phase, mode, rtt, rate, "svc-none"))
        s["vs_svc_none"] = s["tps_median"] / base["tps_median"] if base else math.nan
        # The in-process peer runs without any link; compare against its main-phase cell.
        peer = cells.get(("main", mode, None, None, "hf-target"))
        s["vs_hf_target"] = s["tps_median"] / peer["tps_median"] if peer else math.nan
        twin = {"draft": f"hf-assisted-k{s['k']}", "lookup": f"hf-lookup-k{s['k']}"}.get(
            s["proposer"] if s["family"] == "svc" and s["k"] else ""
        )  # svc-draft-auto has no fixed-k twin
        twin_cell = cells.get(("main", mode, None, None, twin)) if twin else None
        s["hf_twin"] = twin if twin_cell else None
        s["vs_hf_twin"] = s["tps_median"] / twin_cell["tps_median"] if twin_cell else math.nan
    return sorted(cells.values(), key=_order)


def _structured_counts(cells: dict[tuple, dict], groups: dict[tuple, list[dict]]) -> None:
    """Per structured cell: requests whose text is valid for its pair, and requests whose tokens
    equal constrained target-only's (rep 0 of the phase's svc-none, the same grammar)."""
    ref = {r["prompt_id"]: r["token_ids"] for key, recs in groups.items()
           if key[0] == "structured" and key[-1] == "svc-none" for r in recs if r["rep"] == 0}
    for key, recs in groups.items():
        if key[0] == "structured":
            cells[key].update(valid=sum(bool(r.get("valid")) for r in recs),
                              identical=sum(r["token_ids"] == ref.get(r["prompt_id"]) for r in recs),
                              pairs=len({r["prompt_id"] for r in recs}))


def _order(s: dict) -> tuple:
    fam = {"svc": 0, "hf": 1}[s["family"]]
    # Target-only first, then the registry's order; the in-process peers beside their service twins.
    kinds = ["none", *(name for name in names(plugins=False) if name != "none")]
    prop = {name: i for i, name in enumerate(kinds)}
    prop.update(target=prop["none"], assisted=prop["draft"], adaptive=len(kinds))
    return (
        {"main": 0, "rtt": 1, "rate": 2, "prediction": 3}.get(s["phase"], 4),  # then structured
        s["mode"] != "greedy",
        -1.0 if s.get("rtt_ms") is None else s["rtt_ms"],  # direct first
        -1.0 if s.get("rate_mbps") is None else s["rate_mbps"],
        fam,
        prop.get(s["proposer"], 9),
        s.get("parallel", False),  # svc-draft-par-k* after the sequential draft cells
        s["k"] or 10**6,  # svc-draft-auto after the fixed k
    )


def speedup_model(summaries: list[dict], mode: str, phase: str = "main") -> dict:
    """Measured vs predicted: tokens per round vs (1-a^(k+1))/(1-a), speed-up vs E/(v+k*c).

    T1 = target ms per pass with no proposer; v_k = target ms per pass at k / T1
    (verifying k+1 tokens); c = draft ms per drafted token / T1; a pooled over
    every fixed-k draft cell of this mode (maximum likelihood, censored last
    rounds). svc-draft-auto changes k from round to round, so it gets no
    prediction: `adaptive` holds what it measured, with the mean k it used.
    """
    cells = [s for s in summaries if s["mode"] == mode and s["phase"] == phase
             and s["family"] == "svc" and s.get("rtt_ms") is None and s.get("rate_mbps") is None]
    base = next((s for s in cells if s["proposer"] == "none"), None)
    drafts = sorted((s for s in cells if s["proposer"] == "draft" and s["k"] and not s.get("parallel")),
                    key=lambda s: s["k"])
    parallel = sorted((s for s in cells if s["proposer"] == "draft" and s["k"] and s.get("parallel")),
                      key=lambda s: s["k"])
    auto = next((s for s in cells if is_adaptive(s)), None)
    if base is None or not (drafts or auto or parallel):
        return {}
    t1 = base["target_ms_per_pass"]
    acc = sum(s.get("alpha_accepted", 0) for s in drafts + parallel)  # the same proposals
    trials = sum(s.get("alpha_trials", 0) for s in drafts + parallel)
    alpha = acc / trials if trials else math.nan
    rows = []
    for s in drafts:
        k = s["k"]
        b = s["breakdown"]
        c = s["draft_ms_per_drafted"] / t1 if t1 else math.nan
        v = s["target_ms_per_pass"] / t1 if t1 else math.nan
        e = expected_tokens_per_round(alpha, k)
        e_own = expected_tokens_per_round(s.get("alpha", math.nan), k)
        rows.append({
            "k": k,
            "alpha": s.get("alpha"),
            "tokens_per_pass_measured": s["tokens_per_pass"],
            "tokens_per_pass_predicted": e,
            "tokens_per_pass_predicted_own_alpha": e_own,
            "c": c,
            "v": v,
            "speedup_predicted": e / (v + k * c),
            "speedup_measured": s["vs_svc_none"],
            "round_ms_measured": b["total_ms"]["median"],
            "round_ms_model": (v + k * c) * t1,
        })
    par_rows = [_parallel_row(s, alpha, t1) for s in parallel]
    adaptive = None
    if auto is not None:
        adaptive = {
            "config": auto["config"], "k_mean": auto.get("k_mean"), "k_min": auto.get("k_min"),
            "k_max": auto.get("k_max"), "alpha": auto.get("alpha"),
            "tokens_per_pass_measured": auto["tokens_per_pass"],
            "speedup_measured": auto["vs_svc_none"],
            "round_ms_measured": auto["breakdown"]["total_ms"]["median"],
        }
    return {"mode": mode, "alpha_pooled": alpha, "t1_ms": t1, "rows": rows, "adaptive": adaptive,
            "parallel_rows": par_rows}


def _parallel_row(s: dict, alpha: float, t1: float) -> dict:
    """A parallel cell, measured vs specdec.core.speedup.parallel_speedup.

    v and c as for sequential rows, c from the rounds that called the draft; the
    prediction uses the modelled hit rate alpha^(k+1) and, in brackets, the
    measured one (beta = measured hits / alpha^k).
    """
    k = s["k"]
    v = s["target_ms_per_pass"] / t1 if t1 else math.nan
    c = s.get("draft_ms_per_drafted_called", math.nan) / t1 if t1 else math.nan
    e = expected_tokens_per_round(alpha, k)
    ok = not any(math.isnan(x) for x in (alpha, v, c))
    h_model = pre_draft_hit_rate(alpha, k) if ok else math.nan
    h = s.get("pre_draft_hit_rate", math.nan)
    beta = min(1.0, h / alpha**k) if ok and alpha > 0 and not math.isnan(h) else None
    return {
        "k": k,
        "config": s["config"],
        "alpha": s.get("alpha"),
        "tokens_per_pass_measured": s["tokens_per_pass"],
        "tokens_per_pass_predicted": e,
        "hit_rate_measured": h,
        "hit_rate_predicted": h_model,
        "c": c,
        "v": v,
        "speedup_predicted": parallel_speedup(alpha, k, c, v) if ok else math.nan,
        "speedup_predicted_measured_hits": (parallel_speedup(alpha, k, c, v, beta=beta)
                                            if ok and beta is not None else math.nan),
        "speedup_measured": s["vs_svc_none"],
        "round_ms_measured": s["breakdown"]["total_ms"]["median"],
        "draft_hidden_ms_per_hit": s.get("draft_hidden_ms_per_hit"),
    }


def rtt_prediction(summaries: list[dict], config: str, rtt_ms: float, phase: str = "rtt",
                   mode: str = "greedy") -> float:
    """Speed-up over the same link predicted from the RTT-0 cells: E (T_t + R) / (T_r + 2 R).

    T_t = seconds per token of svc-none, T_r / E = seconds per token of `config`,
    both through the link at RTT 0; E = tokens per round. Target-only pays one
    round trip per token, a speculative round two (propose, then score).
    """
    cells = {s["config"]: s for s in summaries if s["phase"] == phase and s["mode"] == mode
             and s.get("rtt_ms") == 0.0}
    base, spec = cells.get("svc-none"), cells.get(config)
    if not base or not spec or not base["tps_median"] or not spec["tps_median"]:
        return math.nan
    e = spec["tokens_per_pass"]
    rtts = 2.0 if spec["proposer"] == "draft" else 1.0  # lookup runs in the orchestrator
    t_t = 1.0 / base["tps_median"]
    per_token = 1.0 / spec["tps_median"]
    r = rtt_ms / 1000.0
    return (t_t + r) / (per_token + rtts * r / e)


def greedy_mismatches(records: list[dict]) -> list[dict]:
    """Greedy service outputs that differ from target-only through the services.

    The reference is rep 0 of svc-none in the main phase for each prompt (for a
    prompt the main phase did not run, rep 0 of svc-none in the record's own
    phase: the predicted-output cell's, and the structured cell's constrained
    target-only); every other greedy service record (any config, phase, link,
    repetition) must equal it token for token.
    """
    ref = {r["prompt_id"]: r["token_ids"] for r in records
           if r["mode"] == "greedy" and r["config"] == "svc-none" and r["phase"] == "main"
           and r["rep"] == 0}
    # A prompt only another phase ran (predicted-output, structured): that phase's svc-none.
    own = {(r["phase"], r["prompt_id"]): r["token_ids"] for r in records
           if r["mode"] == "greedy" and r["config"] == "svc-none" and r["rep"] == 0}
    bad = []
    for r in records:
        if r["mode"] != "greedy" or r["family"] != "svc":
            continue
        want = ref.get(r["prompt_id"], own.get((r["phase"], r["prompt_id"])))
        if want is not None and r["token_ids"] != want:
            bad.append(_mismatch(r, want))
    return bad


def peer_mismatches(records: list[dict]) -> list[dict]:
    """Greedy in-process outputs that differ from target-only through the services.

    Reported, not fatal: transformers' own assisted/lookup decoding and its
    batched-vs-incremental numerics are outside specdec's promise.
    """
    ref = {r["prompt_id"]: r["token_ids"] for r in records
           if r["mode"] == "greedy" and r["config"] == "svc-none" and r["phase"] == "main"
           and r["rep"] == 0}
    bad = []
    for r in records:
        if r["mode"] != "greedy" or r["family"] != "hf" or r["rep"] != 0:
            continue
        want = ref.get(r["prompt_id"])
        if want is not None and r["token_ids"] != want:
            bad.append(_mismatch(r, want))
    return bad


def _mismatch(rec: dict, want: list[int]) -> dict:
    got = rec["token_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {
        "prompt_id": rec["prompt_id"], "config": rec["config"], "phase": rec["phase"],
        "rtt_ms": rec.get("rtt_ms"), "rate_mbps": rec.get("rate_mbps"), "rep": rec["rep"],
        "first_difference": first, "len_got": len(got), "len_want": len(want),
    }


def by_category(records: list[dict]) -> list[dict]:
    """Main-phase tokens/s per (mode, config, prompt category) and its ratios to svc-none and to
    hf-target (in-process generate) there.

    tokens/s per category = median over repetitions of (tokens / seconds summed
    over the category's prompts), as for the whole cell.
    """
    cells: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        if rec["phase"] == "main" and rec.get("category"):
            cells[(rec["mode"], rec["config"], rec["category"])][rec["rep"]].append(rec)
    tps = {key: median([sum(r["new_tokens"] for r in rs) / max(1e-9, sum(r["wall_s"] for r in rs))
                        for rs in reps.values()])
           for key, reps in cells.items()}
    rows = []
    for (mode, config, category), value in sorted(tps.items()):
        base = tps.get((mode, "svc-none", category))
        plain = tps.get((mode, "hf-target", category))
        rows.append({"mode": mode, "config": config, "category": category, "tps_median": value,
                     "vs_svc_none": value / base if base else math.nan,
                     "vs_hf_target": value / plain if plain else math.nan})
    return rows


def analyse(records: list[dict]) -> dict:
    """Summaries, model-vs-measurement tables and the identity checks of one run."""
    summaries = summarize(records)
    greedy_bad = greedy_mismatches(records)
    peer_bad = peer_mismatches(records)
    return {
        "summaries": summaries,
        "by_category": by_category(records),
        "models": [speedup_model(summaries, m) for m in ("greedy", "sampling")],
        "checks": {
            "greedy_mismatches": greedy_bad,
            "greedy_passed": not greedy_bad,
            "greedy_compared": sum(1 for r in records if r["mode"] == "greedy" and r["family"] == "svc"),
            "peer_mismatches": peer_bad,
            "peer_compared": sum(1 for r in records if r["mode"] == "greedy" and r["family"] == "hf"
                                 and r["rep"] == 0),
            "prompt_token_mismatches": _prompt_token_mismatches(records),
        },
    }


def _prompt_token_mismatches(records: list[dict]) -> list[str]:
    """Prompts the in-process peer tokenised differently from the orchestrator."""
    svc, hf = {}, {}
    for r in records:
        (svc if r["family"] == "svc" else hf)[r["prompt_id"]] = r.get("prompt_tokens")
    return sorted(p for p in hf if p in svc and hf[p] != svc[p])

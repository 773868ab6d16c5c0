"""The load benchmark's arithmetic: histogram deltas, inter-token latency, the goal table."""
from __future__ import annotations

import os

from benchmarks.load.bench import cpu_per_stream_round, histogram_delta, limit_sizes, parse_scrape, proc_cpu_s
from benchmarks.load.report import _itl, decode_phase, forward_ms, goals, identity, rep_ratios, summarize


def test_histogram_delta_gives_the_batches_formed_in_between() -> None:
    before = {"target": {"specdec_batch_rows": {"count": 10.0, "sum": 10.0,
                                                "buckets": {"1.0": 10.0, "4.0": 10.0, "+Inf": 10.0}}}}
    after = {"target": {"specdec_batch_rows": {"count": 14.0, "sum": 22.0,
                                               "buckets": {"1.0": 11.0, "4.0": 14.0, "+Inf": 14.0}}}}
    d = histogram_delta(before, after)["target"]["batch_rows"]
    assert d == {"forwards": 4.0, "mean": 3.0, "sum": 12.0, "buckets": {"1.0": 1.0, "4.0": 3.0}}
    assert histogram_delta({}, {"draft": {}}) == {}


def test_cpu_per_stream_round_takes_the_forward_passes_out_of_a_service() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    passes = Counter("specdec_pass_seconds", "the engine's own counter's name", registry=registry)
    passes.inc(1.5)
    before = parse_scrape({"target": generate_latest(registry).decode()})
    passes.inc(0.5)
    after = parse_scrape({"target": generate_latest(registry).decode()})
    batches = histogram_delta(before, after)
    assert batches["target"]["pass_seconds"]["sum"] == 0.5
    cpu = cpu_per_stream_round({"orchestrator-default": 1.0, "orchestrator": 5.0, "target": 2.0, "client": 0.0},
                               {"orchestrator-default": 1.2, "orchestrator": 5.0, "target": 2.9, "client": 0.1},
                               batches, rounds=1000, orchestrator="orchestrator-default")
    # 0.2 s over 1000 stream-rounds; the target's 0.9 s less its 0.5 s of passes.
    assert {k: round(v, 3) for k, v in cpu.items()} == {
        "orchestrator": 200.0, "client": 100.0, "target": 400.0, "target_forward": 500.0}
    assert cpu_per_stream_round({}, {}, batches, rounds=10, orchestrator="orchestrator") is None
    assert cpu_per_stream_round({"target": 1.0}, {"target": 2.0}, {}, rounds=0, orchestrator="x") is None
    assert proc_cpu_s(os.getpid()) > 0 and proc_cpu_s(2 ** 30) is None


def test_itl_spreads_a_chunk_over_its_tokens() -> None:
    stream = {"chunks": [(0.1, 1), (0.3, 4), (0.4, 1)]}
    assert [round(x, 6) for x in _itl(stream)] == [50.0] * 4 + [100.0]


def _record(mode: str, config: str, n: int, end_s: float, tokens: list[int], ttft_s: float = 0.1) -> dict:
    streams = [{"prompt_id": f"p{i}", "token_ids": tokens, "chunks": [(ttft_s, 1), (end_s, len(tokens) - 1)],
                "end_s": end_s, "ttft_s": ttft_s, "rounds_k": [0, 2]} for i in range(n)]
    return {"rep": 0, "n": n, "mode": mode, "config": config, "streams": streams, "batches": {}}


def test_goal_table_met_and_missed() -> None:
    ref = {f"p{i}": [1, 2, 3, 4] for i in range(16)}
    records = []
    for n, end in ((1, 1.0), (8, 1.5), (16, 2.0)):  # 4, 21.3 and 32 tokens/s
        records.append(_record("batched", "target-only", n, end, [1, 2, 3, 4], ttft_s=0.1 if n == 1 else 0.3))
        records.append(_record("batched", "adaptive", n, end * 0.9, [1, 2, 3, 4]))
        records.append(_record("peer", "hf-padded", n, end * 2, [1, 2, 3, 4]))
    summaries = summarize(records)
    ident = identity(records, ref)
    # The physical limit (one in-process forward over N rows): 8 at N = 1, 24 at N = 8, 40 at N = 16.
    limit = {"1": {"limit_tps": 8.0}, "8": {"limit_tps": 24.0}, "16": {"limit_tps": 40.0}}
    table = {g["figure"]: g for g in goals(summaries, ident, {"ns": [1, 8, 16], "physical_limit": limit})}
    whole = "target-only aggregate tokens/s at N={} / physical limit (whole cell, prefill included)"
    assert table[whole.format(8)]["met"] is True  # 21.3 / 24
    assert table[whole.format(16)]["met"] is False  # 32 / 40
    rows = "target rows per forward at N=16, target-only (whole cell, prefill chunks included)"
    assert table[rows]["met"] is None  # no histograms here
    assert table["target-only decode phase at N=16 / physical limit of the same streams"]["met"] is None
    assert table["adaptive / target-only aggregate tokens/s, every N"]["met"] is True
    assert table["batched target-only / in-process padded generate, every N"]["met"] is True
    assert table["greedy identity (every stream = target-only alone)"]["met"] is True
    records[1]["streams"][0]["token_ids"] = [1, 2, 9, 4]
    ident = identity(records, ref)
    assert [m["first_difference"] for m in ident["mismatches"]] == [2] and not ident["passed"]
    assert ident["peer_compared"] == 25 and ident["peer_differ"] == []


def test_ratios_by_repetition_pair_the_cells_of_each_repetition() -> None:
    records = []
    for rep, (base_end, spec_end) in enumerate(((1.0, 0.8), (2.0, 2.5), (1.5, 1.5))):
        for config, end in (("target-only", base_end), ("default", spec_end)):
            record = _record("batched", config, 4, end, [1, 2, 3, 4])
            record["rep"] = rep
            records.append(record)
    summaries = summarize(records)
    assert [round(r, 3) for r in rep_ratios(summaries, "default", 4)] == [1.25, 0.8, 1.0]
    table = {g["figure"]: g for g in goals(summaries, {"compared": 0, "mismatches": [], "passed": True},
                                           {"ns": [4]})}
    note = table["default / target-only aggregate tokens/s, every N"]["note"]
    assert note == "N=4: 1.00 (by repetition 1.25 0.80 1.00; target-only's own spread 100%)"


def test_forward_cost_is_interpolated_between_measured_row_counts() -> None:
    limit = {"1": {"forward_ms": 10.0}, "4": {"forward_ms": 16.0}, "8": {"forward_ms": 24.0}}
    assert forward_ms(limit, 1) == 10.0
    assert forward_ms(limit, 2) == 12.0
    assert forward_ms(limit, 6) == 20.0
    assert forward_ms(limit, 16) == 40.0  # past the last: the last two's slope
    assert forward_ms({}, 3) is None
    noisy = {"1": {"forward_ms": 10.0}, "2": {"forward_ms": 30.0}, "3": {"forward_ms": 14.0}}
    assert forward_ms(noisy, 2) == 14.0  # no dearer than the 3-row forward measured
    assert limit_sizes([1, 16]) == list(range(1, 17))
    assert limit_sizes([1, 64]) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def test_decode_phase_against_the_limit_of_the_same_streams() -> None:
    # Two streams; every stream has its first token at 0.5 s; then 4 and 2 tokens more, the
    # last at 1.5 s. A full batch: steps of 2, 2, 1, 1 rows; with forwards of 100 ms (1 row)
    # and 150 ms (2 rows) the limit is 6 tokens in 0.5 s.
    streams = [{"chunks": [(0.4, 1), (0.8, 2), (1.5, 2)], "end_s": 1.5},
               {"chunks": [(0.5, 1), (1.0, 2)], "end_s": 1.0}]
    limit = {"1": {"forward_ms": 100.0}, "2": {"forward_ms": 150.0}}
    record = {"n": 2, "streams": streams, "decode": {"start_s": 0.5, "batches": {
        "target": {"batch_rows": {"forwards": 5.0, "mean": 1.4}}}}}
    phase = decode_phase(record, limit)
    assert phase["tokens"] == 6 and phase["span_s"] == 1.0 and phase["tps"] == 6.0
    assert phase["limit_tps"] == 12.0 and phase["efficiency"] == 0.5
    assert phase["ideal_rows"] == 1.5 and phase["rows"] == 1.4
    assert decode_phase({"streams": streams}, limit) is None  # no decode mark: not measured
    no_limit = decode_phase(record, {})
    assert no_limit["tps"] == 6.0 and no_limit["limit_tps"] is None and no_limit["efficiency"] is None


def test_the_decode_limit_follows_the_cell_s_own_measurement() -> None:
    # The curve said 150 ms for 2 rows; measured next to this cell, 300 ms: the limit halves.
    streams = [{"chunks": [(0.4, 1), (0.8, 2), (1.5, 2)], "end_s": 1.5},
               {"chunks": [(0.5, 1), (1.0, 2)], "end_s": 1.0}]
    limit = {"1": {"forward_ms": 100.0}, "2": {"forward_ms": 150.0}}
    record = {"n": 2, "streams": streams, "limit_ms": 300.0, "decode": {"start_s": 0.5, "batches": {}}}
    assert decode_phase(record, limit)["limit_tps"] == 6.0
    # Measured with the sessions holding the phase's mean context too: that one holds the phase.
    grown = {**record, "decode_limit_ms": 200.0}
    assert decode_phase(grown, limit)["limit_tps"] == 9.0


def test_a_cells_decode_phase_is_one_repetitions_own_figures() -> None:
    """The summary's decode phase is the repetition with the median efficiency, whole: its
    tokens/s over its limit is its efficiency (per-figure medians mixed three repetitions)."""
    from benchmarks.load.report import _median_rep

    reps = [{"tps": 100.0, "limit_tps": 200.0, "efficiency": 0.5},
            {"tps": 170.0, "limit_tps": 200.0, "efficiency": 0.85},
            {"tps": 120.0, "limit_tps": 120.0, "efficiency": 1.0}]
    phase = _median_rep(reps)
    assert phase == reps[1] and phase["tps"] / phase["limit_tps"] == phase["efficiency"]
    assert _median_rep(reps[:2]) == reps[0]  # an even count: the lower one
    unmeasured = [{"tps": 1.0, "efficiency": None}, {"tps": 3.0, "efficiency": None}]
    assert _median_rep(unmeasured)["tps"] == 2.0  # no efficiency anywhere: per-figure medians


def test_the_gpu_projection_adds_the_measured_control_plane_to_the_gpu_s_step() -> None:
    from types import SimpleNamespace

    from benchmarks.load import projection

    result = {"settings": {"physical_limit": {"1": {"limit_tps": 1000.0}}}, "summaries": [
        {"mode": "batched", "config": "target-only", "n": 1, "cell_limit_tps": 500.0,
         "round_parts": {"round": 3.0}, "cpu_us": {"orchestrator": 900.0, "target": 300.0}},
        {"mode": "batched", "config": "target-only", "n": 64, "round_parts": {"round": 40.0},
         "cpu_us": {"orchestrator": 400.0, "target": 100.0}},
        {"mode": "batched", "config": "default", "n": 64, "cpu_us": {"orchestrator": 9e9}},
    ]}
    cp = projection.control_plane(result)
    # c0: the N = 1 round less its own cell's forward (2 ms); c1: the largest N's serial CPU.
    assert cp["c0"] == 1.0 and cp["c1"] == 0.5 and cp["n_top"] == 64
    ns = SimpleNamespace(ns=[1, 10], taus=[2.0], k=2, context=0, weights=3.35e9, kv_per_token=0.0,
                         bandwidth=3.35e12, draft_ms=0.5)
    one, ten = projection.rows(cp, ns)
    assert one["target_ms"] == 1.0 and one["control_ms"] == 1.0 and ten["control_ms"] == 5.5
    assert one["plain_vs_inprocess"] == 1.0 / 2.0
    # 2 tokens per round of 1 ms + 2 x 0.5 ms drafting + 1 ms control, against 1 token per 2 ms.
    assert abs(one["tau2.0"] - (2.0 / 3.0) / (1 / 2.0)) < 1e-12
    assert abs(one["tau2.0_ideal"] - 1.0) < 1e-12  # 2 tokens per 2 ms of GPU against 1 per 1 ms
    text = projection.markdown(cp, [one, ten], ns, "a run")
    assert "a projection, not a measurement" in text and "| 10 |" in text


def test_tiny_models_can_carry_a_real_model_s_vocabulary(tmp_path) -> None:
    """benchmarks.load --tiny-vocab: the tiny tokenizer padded with added tokens to the size asked."""
    from tests.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path, pad_to=1000)
    assert len(tok) == 1000
    assert tok.decode([999]) == "<|v615|>"  # 384 trained ids, then <|v0|> .. <|v615|>
    assert tok.encode("the cat sat") == build_tokenizer(tmp_path / "plain").encode("the cat sat")

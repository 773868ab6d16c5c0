"""A dashboard written for vLLM's metrics, read against specdec's: the PromQL of its panels is
evaluated (tests/promql.py) over two real scrapes of a live stack with generations in between,
and what it shows must be what the generations' own Stats say.

The queries are the shapes vLLM's Grafana dashboards use (model_name="$model_name", rates over
$__rate_interval, histogram quantiles): spec-decode acceptance rate, mean acceptance length and
acceptance per position, end-to-end and inter-token latency, token throughput, requests running
and waiting, finished requests, KV-cache usage. docs/operations.md lists them.
"""
from __future__ import annotations

import math
import time
import urllib.request

import pytest

from tests.integration.test_gateway import gw  # noqa: F401 - the module's stack and gateway
from tests.promql import Evaluator, parse_scrape

SEL = '{model_name="$model_name"}'
VLLM_QUERIES = {
    "acceptance rate": f"sum(rate(vllm:spec_decode_num_accepted_tokens_total{SEL}[$__rate_interval])) / "
                       f"sum(rate(vllm:spec_decode_num_draft_tokens_total{SEL}[$__rate_interval]))",
    "mean acceptance length": f"1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total{SEL}[$__rate_interval])) / "
                              f"sum(rate(vllm:spec_decode_num_drafts_total{SEL}[$__rate_interval]))",
    "acceptance by position": f"sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{SEL}"
                              f"[$__rate_interval])) / scalar(sum(rate(vllm:spec_decode_num_drafts_total{SEL}"
                              f"[$__rate_interval])))",
    "e2e latency p50": f"histogram_quantile(0.5, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{SEL}"
                       f"[$__rate_interval])))",
    "e2e latency mean": f"rate(vllm:e2e_request_latency_seconds_sum{SEL}[$__rate_interval]) / "
                        f"rate(vllm:e2e_request_latency_seconds_count{SEL}[$__rate_interval])",
    "inter-token latency p95": f"histogram_quantile(0.95, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket"
                               f"{SEL}[$__rate_interval])))",
    "time per output token p50": f"histogram_quantile(0.5, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket"
                                 f"{SEL}[$__rate_interval])))",
    "time to first token p50": f"histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket"
                               f"{SEL}[$__rate_interval])))",
    "generation tokens/s": f"rate(vllm:generation_tokens_total{SEL}[$__rate_interval])",
    "prompt tokens/s": f"rate(vllm:prompt_tokens_total{SEL}[$__rate_interval])",
    "finished by reason": f"sum by (finished_reason) (increase(vllm:request_success_total{SEL}[$__rate_interval]))",
    "running": f"vllm:num_requests_running{SEL}",
    "waiting": f"vllm:num_requests_waiting{SEL}",
    "kv cache usage": f"vllm:kv_cache_usage_perc{SEL}",
}


def _scrape(gw) -> dict:  # noqa: F811
    merged: dict = {}
    for port in gw.metrics.values():
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for name, series in parse_scrape(body).items():
            merged.setdefault(name, {}).update(series)
    return merged


def _one(value) -> float:
    assert isinstance(value, dict) and len(value) == 1, value
    return next(iter(value.values()))


def test_a_vllm_dashboard_shows_specdecs_acceptance(gw):  # noqa: F811
    from client import Client

    before, started = _scrape(gw), time.monotonic()
    stats = []
    with Client(gw.stack.addresses["orch"], timeout=120) as c:
        for prompt in ("The cat sat on the mat", "A quick brown fox", "def add(a, b):"):
            stats.append(c.complete(prompt, max_new_tokens=24, temperature=0.0, proposer="draft", k=3).stats)
        # Kept: its KV stays on the target, so the cache usage is above 0.
        stats.append(c.complete("The capital of France", max_new_tokens=16, temperature=0.0, proposer="none",
                                keep_session=True).stats)
    after, seconds = _scrape(gw), time.monotonic() - started
    ev = Evaluator(before, after, seconds, {"model_name": "target", "__rate_interval": "1m"})
    shown = {name: ev(query) for name, query in VLLM_QUERIES.items()}
    print("\n" + "\n".join(f"{name}: {value}" for name, value in shown.items()))

    drafted = sum(s.drafted_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    drafts = sum(1 for s in stats for r in s.rounds if r.drafted)
    assert drafted and accepted  # speculation happened and was accepted, so the check is not vacuous
    assert _one(shown["acceptance rate"]) == pytest.approx(accepted / drafted)
    assert _one(shown["mean acceptance length"]) == pytest.approx(1 + accepted / drafts)
    by_position = {dict(k)["position"]: v for k, v in shown["acceptance by position"].items()}
    first = sum(s.rounds[i].accepted >= 1 for s in stats for i in range(len(s.rounds)) if s.rounds[i].drafted)
    assert by_position["0"] == pytest.approx(first / drafts)
    assert _one(shown["generation tokens/s"]) * seconds == pytest.approx(sum(s.new_tokens for s in stats))
    assert _one(shown["prompt tokens/s"]) * seconds == pytest.approx(sum(s.prompt_tokens for s in stats))
    finished = {dict(k)["finished_reason"]: v for k, v in shown["finished by reason"].items() if v}
    assert sum(finished.values()) == len(stats) and set(finished) <= {"stop", "length"}
    mean_e2e = _one(shown["e2e latency mean"])
    assert mean_e2e == pytest.approx(sum(s.total_ms for s in stats) / 1e3 / len(stats), rel=1e-6)
    for name in ("e2e latency p50", "inter-token latency p95", "time per output token p50", "time to first token p50"):
        assert 0 < _one(shown[name]) < 60 and not math.isnan(_one(shown[name])), name
    assert _one(shown["running"]) == 0 and _one(shown["waiting"]) == 0
    usage = shown["kv cache usage"]  # the target's (the draft's model_name is its own)
    assert len(usage) == 1 and 0 < _one(usage) <= 1, usage

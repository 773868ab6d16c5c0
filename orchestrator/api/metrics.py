"""Prometheus metrics of the orchestrator (served by the bootstrap's --metrics-port).

specdec's own series, and beside them the same quantities under vLLM's names (`vllm:...`, with
its `model_name` and `engine` labels), so that dashboards, alerts and autoscalers written for
vLLM read specdec: the spec-decode counters (a draft is a round that drafted; positions count
from 0), end-to-end, first-token and inter-token latency (one observation per round after the
first: a round is vLLM's engine step, its chunk the tokens of that step), prompt and generation
tokens, finished requests, and requests running and waiting (admitted onto a target replica,
waiting for a slot: orchestrator.policy.capacity). The model services export the KV-cache
fraction (engine.metrics).
"""
from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from orchestrator.common.stats import Tally

GENERATIONS = Counter("specdec_generations_total", "Finished generations",
                      ["proposer", "finish_reason"])
FALLBACKS = Counter("specdec_proposer_fallbacks_total", "Generations that fell back to target-only")
NEW_TOKENS = Counter("specdec_generated_tokens_total", "Tokens committed and streamed")
TARGET_PASSES = Counter("specdec_target_passes_total", "Target Score calls")
DRAFTED = Counter("specdec_drafted_tokens_total", "Tokens proposed", ["proposer"])
ACCEPTED = Counter("specdec_accepted_tokens_total", "Proposed tokens the target accepted", ["proposer"])
REUSED = Counter("specdec_reused_prompt_tokens_total", "Prompt tokens served from a cached prefix")
TTFT = Histogram("specdec_ttft_seconds", "Time to the first streamed chunk",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
DRAFTED_AT = Counter("specdec_drafted_at_position_total",
                     "Rounds that drafted a token at this draft position (1 = first drafted token)",
                     ["position"])
ACCEPTED_AT = Counter("specdec_accepted_at_position_total",
                      "Rounds whose drafted token at this position was accepted", ["position"])
PHASES = ("draft", "target", "network", "serialize", "orchestrator", "redis")
ROUND_PHASE = Histogram("specdec_round_phase_seconds",
                        "Time of one round spent in each phase (Stats.rounds: draft and target "
                        "compute, network, serialization, orchestrator, Redis waits)", ["phase"],
                        buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                 0.1, 0.25, 0.5, 1.0))
# Every series exists before the first generation; kept, as every round of every generation
# observes each (labels() per observation was 2% of a loaded orchestrator's CPU).
_PHASE_SERIES = tuple((f"{phase}_ms", ROUND_PHASE.labels(phase)) for phase in PHASES)
TREE_NODES = Histogram("specdec_tree_nodes", "Tokens of a round's token tree (rounds that drafted a tree)",
                       buckets=(2, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64))
TREE_DEPTH = Histogram("specdec_tree_accepted_depth", "Depth of the path a token tree's round accepted",
                       buckets=(0, 1, 2, 3, 4, 5, 6, 8))
TREE_RANK = Counter("specdec_tree_accepted_by_rank_total",
                    "Accepted tree tokens by their rank among their siblings (0 = the draft's first "
                    "candidate)", ["rank"])
OVERHEAD = Histogram("specdec_round_overhead_seconds",
                     "Median per-round time outside the services' compute, per generation",
                     buckets=(0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05))


def observe(t: Tally) -> None:
    """Record one finished generation (specdec's series and vLLM's)."""
    observe_vllm(t)
    GENERATIONS.labels(t.proposer, t.finish_reason).inc()
    if t.fallback_reason:
        FALLBACKS.inc()
    NEW_TOKENS.inc(t.new_tokens)
    TARGET_PASSES.inc(t.target_passes)
    DRAFTED.labels(t.proposer).inc(t.drafted_tokens)
    ACCEPTED.labels(t.proposer).inc(t.accepted_tokens)
    REUSED.inc(t.reused_prompt_tokens)
    TTFT.observe(t.ttft_ms / 1e3)
    OVERHEAD.observe(t.overhead_p50_ms / 1e3)
    for i, (drafted, accepted) in enumerate(zip(t.drafted_at, t.accepted_at), 1):
        DRAFTED_AT.labels(str(i)).inc(drafted)
        ACCEPTED_AT.labels(str(i)).inc(accepted)
    for field, series in _PHASE_SERIES:
        observe_all(series, [getattr(r, field) / 1e3 for r in t.rounds])
    for r in t.rounds:
        if r.tree:
            TREE_NODES.observe(r.drafted)
            TREE_DEPTH.observe(r.accepted)
            for rank in r.accepted_ranks:
                TREE_RANK.labels(str(rank)).inc()


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every value, in one pass: a generation's rounds are observed
    together when it ends, and Histogram.observe scans the buckets and takes a lock per value (at
    millisecond rounds, several observations per round were a visible part of the orchestrator's
    CPU). Each bucket touched, and the sum, are incremented once; no exemplars."""
    if not values:
        return
    bounds = histogram._upper_bounds  # prometheus_client's own, ending with +Inf
    histogram._sum.inc(sum(values))
    for i, n in collections.Counter(bisect.bisect_left(bounds, v) for v in values).items():
        if i < len(bounds):  # a NaN falls in no bucket, as with observe
            histogram._buckets[i].inc(n)


# ---------------------------------------------------------------- vLLM's names for the same quantities

_VLLM = ["model_name", "engine"]
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
SD_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Rounds that drafted (vLLM's spec-decode drafts)", _VLLM)
SD_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens (specdec_drafted_tokens_total)",
                          _VLLM)
SD_ACCEPTED = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted drafted tokens "
                      "(specdec_accepted_tokens_total)", _VLLM)
SD_ACCEPTED_AT = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted drafted tokens at each "
                         "draft position, from 0 (specdec_accepted_at_position_total's position - 1)",
                         [*_VLLM, "position"])
E2E = Histogram("vllm:e2e_request_latency_seconds", "A generation's whole time", _VLLM, buckets=_E2E_BUCKETS)
VLLM_TTFT = Histogram("vllm:time_to_first_token_seconds", "Time to the first streamed chunk "
                      "(specdec_ttft_seconds)", _VLLM, buckets=_TTFT_BUCKETS)
ITL = Histogram("vllm:inter_token_latency_seconds", "Time between a generation's chunks (one per round "
                "after the first)", _VLLM, buckets=_ITL_BUCKETS)
# The same observations under the name vLLM's older dashboards read.
TPOT = Histogram("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds under vLLM's "
                 "earlier name", _VLLM, buckets=_ITL_BUCKETS)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens of finished generations", _VLLM)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Generated tokens (specdec_generated_tokens_total)", _VLLM)
SUCCESS = Counter("vllm:request_success", "Finished generations by finish reason", [*_VLLM, "finished_reason"])
RUNNING = Gauge("vllm:num_requests_running", "Streams admitted onto a target replica", _VLLM)
WAITING = Gauge("vllm:num_requests_waiting", "Streams waiting for a slot on a target replica", _VLLM)
_FINISHED = {"eos": "stop", "stop": "stop", "length": "length"}
_labels = {"model_name": "", "engine": "0"}


def bind(config) -> None:
    """Name the served model in vLLM's labels, and read running and waiting from the admission."""
    _labels["model_name"] = config.model_name
    admission = config.admission
    RUNNING.labels(**_labels).set_function(lambda: len(admission.active))
    WAITING.labels(**_labels).set_function(lambda: admission.waiting)


def observe_vllm(t: Tally) -> None:
    """One finished generation under vLLM's names."""
    labels = _labels
    SD_DRAFTS.labels(**labels).inc(sum(1 for r in t.rounds if r.drafted))
    SD_DRAFT_TOKENS.labels(**labels).inc(t.drafted_tokens)
    SD_ACCEPTED.labels(**labels).inc(t.accepted_tokens)
    for position, accepted in enumerate(t.accepted_at):
        SD_ACCEPTED_AT.labels(**labels, position=str(position)).inc(accepted)
    E2E.labels(**labels).observe(t.total_ms / 1e3)
    VLLM_TTFT.labels(**labels).observe(t.ttft_ms / 1e3)
    steps = [r.total_ms / 1e3 for r in t.rounds[1:] if r.committed]
    observe_all(ITL.labels(**labels), steps)
    observe_all(TPOT.labels(**labels), steps)
    PROMPT_TOKENS.labels(**labels).inc(t.prompt_tokens)
    GENERATION_TOKENS.labels(**labels).inc(t.new_tokens)
    SUCCESS.labels(**labels, finished_reason=_FINISHED.get(t.finish_reason, t.finish_reason)).inc()

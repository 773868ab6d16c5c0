"""Prometheus metrics of the orchestrator (served by the bootstrap's --metrics-port)."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

from orchestrator.round.stats import Tally

GENERATIONS = Counter("specdec_generations_total", "Finished generations",
                      ["proposer", "finish_reason"])
FALLBACKS = Counter("specdec_proposer_fallbacks_total", "Generations that fell back to target-only")
NEW_TOKENS = Counter("specdec_generated_tokens_total", "Tokens committed and streamed")
TARGET_PASSES = Counter("specdec_target_passes_total", "Target Score calls")
DRAFTED = Counter("specdec_drafted_tokens_total", "Tokens proposed", ["proposer"])
ACCEPTED = Counter("specdec_accepted_tokens_total", "Proposed tokens the target accepted", ["proposer"])
REUSED = Counter("specdec_reused_prompt_tokens_total", "Prompt tokens served from a cached prefix")
CACHE_MISSES = Counter("specdec_orchestrator_cache_misses_total", "Cache misses recovered by resending")
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
OVERHEAD = Histogram("specdec_round_overhead_seconds",
                     "Median per-round time outside the services' compute, per generation",
                     buckets=(0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05))


def observe(t: Tally) -> None:
    """Record one finished generation."""
    GENERATIONS.labels(t.proposer, t.finish_reason).inc()
    if t.fallback_reason:
        FALLBACKS.inc()
    NEW_TOKENS.inc(t.new_tokens)
    TARGET_PASSES.inc(t.target_passes)
    DRAFTED.labels(t.proposer).inc(t.drafted_tokens)
    ACCEPTED.labels(t.proposer).inc(t.accepted_tokens)
    REUSED.inc(t.reused_prompt_tokens)
    CACHE_MISSES.inc(t.cache_misses)
    TTFT.observe(t.ttft_ms / 1e3)
    OVERHEAD.observe(t.overhead_p50_ms / 1e3)
    for i, (drafted, accepted) in enumerate(zip(t.drafted_at, t.accepted_at), 1):
        DRAFTED_AT.labels(str(i)).inc(drafted)
        ACCEPTED_AT.labels(str(i)).inc(accepted)
    for r in t.rounds:
        for field, series in _PHASE_SERIES:
            series.observe(getattr(r, field) / 1e3)

"""Prometheus metrics of a model service (served by the bootstrap's --metrics-port).

Requests by method and status are counted by the server bootstrap
(`specdec_requests_total`); these cover the model work and the KV caches. Each
role counts its own tokens (target_service.scoring, draft_service.drafting).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

FORWARD_SECONDS = Histogram(
    "specdec_forward_seconds",
    "Model work per call (all forward passes one Score or Propose took part in)",
    ["verb"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
PASS_SECONDS = Counter(
    "specdec_pass_seconds",
    "Wall time of the forward passes, each pass once whatever its rows (the service's time outside "
    "them is its control plane)",
)
QUEUE_SECONDS = Histogram(
    "specdec_queue_seconds",
    "Time a call waited before joining a forward (or running, for Release)",
    buckets=(0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
)
BATCH_ROWS = Histogram(
    "specdec_batch_rows",
    "Requests (one per session) in one forward pass",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
)
BATCH_TOKENS = Histogram(
    "specdec_batch_tokens",
    "Tokens fed in one forward pass (padding rows excluded)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
ACTIVE_SESSIONS = Gauge("specdec_active_sessions", "Sessions holding a KV cache")
CACHE_BYTES = Gauge("specdec_cache_bytes", "Bytes held by all sessions' KV caches")
EVICTIONS = Counter(
    "specdec_cache_evictions_total", "Sessions dropped by the service", ["reason"]
)  # reason: max_sessions, budget, ttl
# vLLM's name for the KV caches' fill (dashboards written for vLLM read it): CACHE_BYTES over the
# service's byte budget (--max-cache-bytes), 1 = full; `model_name` is the loaded model's.
KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage as a fraction of the byte budget (1 = full)",
                 ["model_name", "engine"])
MODEL = {"name": ""}  # set by engine.host.ModelHost


def kv_usage(nbytes: int, budget: int) -> None:
    KV_USAGE.labels(MODEL["name"], "0").set(nbytes / budget if budget > 0 else 0.0)


CACHE_HITS = Counter(
    "specdec_cache_hits_total", "Requests served from the session's cached prefix (cache_position > 0)"
)
CACHE_MISSES = Counter(
    "specdec_cache_misses_total", "Requests answered with FAILED_PRECONDITION cache miss", ["reason"]
)  # reason: unknown_session, beyond_held, prefix_mismatch

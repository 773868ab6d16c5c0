"""Per-tenant quotas: request bytes, message sizes, per-tenant streams and rate, a total bound;
and the bounds on the work one request may ask for.

Each quota has a flag, a name that the RESOURCE_EXHAUSTED message carries,
and a label on `specdec_limit_rejections_total`. The orchestrator's
`TenantQuota` is checked before any tokenising (a stream's slot on a target
replica is another matter: orchestrator.policy.capacity.TargetAdmission):

    quota.rate(tenant)                    # --rate-per-tenant: first, refused calls count too
    quota.check_bytes(request_bytes)      # --max-request-bytes
    with quota.enter(tenant, streams=n, rated=True):  # --max-streams-per-tenant,
        ...                               # --max-in-flight (a request of n choices holds n)

`RequestLimits` bound what one request makes the orchestrator do (stop strings,
a prediction, a grammar and its compile time, top_logprobs); exceeding one is
INVALID_ARGUMENT naming the field, the limit and its flag (orchestrator.api.bounds).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client import Counter

from specdec.runtime.errors import ResourceExhausted

REJECTIONS = Counter(
    "specdec_limit_rejections_total", "requests refused by an admission limit", ["limit"]
)

MARGIN_BYTES = 1 << 20
MAX_SESSION_ID = 256  # characters in a session id, on every service and the orchestrator
MAX_CHOICES = 16  # GenerateRequest.n (the OpenAI `n`): choices of one request


MAX_FEATURE_LAYERS = 8  # ScoreRequest.feature_layers: layers one Score returns side by side (EAGLE-3 reads 3)


def model_message_caps(vocab: int, max_k: int, max_request_tokens: int, *, reads_features: int = 0,
                       returns_features: int = 0) -> tuple[int, int]:
    """(receive, send) gRPC caps for a model service, from what its largest messages can hold.

    Received: a Score/Propose carries at most max_request_tokens int32 varints
    (10 bytes each at worst) plus small fields; a feature draft's Propose also
    one feature row per token (`reads_features` wide). Sent: at most max_k + 1
    rows of dense float32 distributions (the CSR form is only used when
    smaller); a target's Score also one feature row per token sent
    (`returns_features` wide, times MAX_FEATURE_LAYERS). Feature rows are counted in float32, the widest
    encoding, twice over (a batch call holds several sessions' rows).
    """
    receive = 10 * max_request_tokens + 64 * 1024 + 2 * max_request_tokens * reads_features * 4
    send = (max_k + 1) * vocab * 4 + MARGIN_BYTES + 2 * max_request_tokens * returns_features * 4 * MAX_FEATURE_LAYERS
    return receive, send


def reject(limit: str, message: str, *, retry_after_s: float = 0.0) -> ResourceExhausted:
    """The limit's RESOURCE_EXHAUSTED, counted; `retry_after_s` > 0 goes back to the caller as a
    `retry-after` hint (trailing metadata; the gateway's HTTP 429 `Retry-After`)."""
    REJECTIONS.labels(limit=limit).inc()
    return ResourceExhausted(f"{limit}: {message}", retry_after_s=retry_after_s)


@dataclass
class TokenBucket:
    """`rate` tokens a second, holding at most `burst`."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(frozen=True)
class TenantLimits:
    max_request_bytes: int = 1 << 20  # prompt + messages + guess + stop strings, UTF-8
    max_streams_per_tenant: int = 128  # concurrent streams of one tenant (n per Generate); 0 = off
    rate_per_tenant: float = 50.0  # calls a second per tenant (token bucket); 0 = off
    burst_per_tenant: float = 100.0
    max_in_flight: int = 256  # concurrent streams in all; 0 = off
    # Kept (multi-turn) session records per tenant in Redis; a new one past it is refused
    # (RESOURCE_EXHAUSTED max_kept_sessions_per_tenant); 0 = off.
    max_kept_sessions: int = 1000
    # The longest a Generate stream runs, server-side: past it DEADLINE_EXCEEDED max_stream_seconds
    # at its next chunk (its slot and KV go); 0 = off.
    max_stream_s: float = 3600.0

    @property
    def grpc_receive_bytes(self) -> int:
        """The orchestrator's gRPC cap: room for the byte cap, so the cap (counted) answers first."""
        return 2 * self.max_request_bytes + MARGIN_BYTES


class TenantQuota:
    """Per-tenant concurrency and rate, and the total bound (one event loop, no locks)."""

    def __init__(self, limits: TenantLimits) -> None:
        self.limits = limits
        self._streams: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self.in_flight = 0

    def check_bytes(self, size: int) -> None:
        cap = self.limits.max_request_bytes
        if cap and size > cap:
            raise reject("max_request_bytes",
                         f"the request's text is {size} bytes, above this server's limit of {cap}")

    def check_kept(self, held: int) -> None:
        """A new kept session for a tenant already holding `held` (counted in Redis: SessionStore.kept)."""
        cap = self.limits.max_kept_sessions
        if cap and held >= cap:
            raise reject("max_kept_sessions_per_tenant",
                         f"{cap} kept sessions per tenant are held; end one (EndSession) or let one "
                         "expire, or send the request without keep_session")

    def rate(self, tenant: str) -> None:
        """Take one call from the tenant's bucket (every public call, EndSession included)."""
        lim = self.limits
        if lim.rate_per_tenant <= 0:
            return
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) > 10_000:  # forget idle tenants' full buckets
                self._buckets = {t: b for t, b in self._buckets.items() if b.tokens < b.burst}
            bucket = self._buckets[tenant] = TokenBucket(lim.rate_per_tenant,
                                                         max(1.0, lim.burst_per_tenant))
        if not bucket.take():
            raise reject("rate_per_tenant",
                         f"more than {lim.rate_per_tenant:g} calls a second; retry later",
                         retry_after_s=1.0)

    @contextmanager
    def enter(self, tenant: str, streams: int = 1, *, rated: bool = False) -> Iterator[None]:
        """Hold `streams` stream slots of `tenant` (and as many of the total) for the call's
        duration: a request of n choices runs n streams. `rated`: the call's `rate` was taken."""
        lim = self.limits
        if not rated:
            self.rate(tenant)
        needs = f" (this call runs {streams} streams)" if streams > 1 else ""
        if lim.max_in_flight and self.in_flight + streams > lim.max_in_flight:
            raise reject("max_in_flight", f"{lim.max_in_flight} streams in progress at most{needs}; "
                         "retry later", retry_after_s=1.0)
        held = self._streams.get(tenant, 0)
        if lim.max_streams_per_tenant and held + streams > lim.max_streams_per_tenant:
            raise reject("max_streams_per_tenant",
                         f"{lim.max_streams_per_tenant} concurrent streams per tenant{needs}", retry_after_s=1.0)
        self._streams[tenant] = held + streams
        self.in_flight += streams
        try:
            yield
        finally:
            self.in_flight -= streams
            left = self._streams[tenant] - streams
            if left:
                self._streams[tenant] = left
            else:
                del self._streams[tenant]


def tenant_limits_from_args(args: argparse.Namespace) -> TenantLimits:
    return TenantLimits(
        max_request_bytes=int(args.max_request_bytes),
        max_streams_per_tenant=int(args.max_streams_per_tenant),
        rate_per_tenant=float(args.rate_per_tenant),
        burst_per_tenant=float(args.burst_per_tenant),
        max_in_flight=int(args.max_in_flight),
        max_kept_sessions=int(args.max_kept_sessions_per_tenant),
        max_stream_s=float(args.max_stream_seconds),
    )


@dataclass(frozen=True)
class RequestLimits:
    """The work one request may ask for; each bound is INVALID_ARGUMENT naming it (0 = off)."""

    max_stop_strings: int = 32  # stop strings in one request (every token is checked against each)
    max_stop_bytes: int = 2048  # their UTF-8 bytes in all
    max_prediction_bytes: int = 256 << 10  # a Predicted Outputs prediction's UTF-8 bytes
    max_grammar_bytes: int = 64 << 10  # a constraint's text (JSON schema, regex, Lark grammar)
    grammar_compile_s: float = 2.0  # longest wait for a constraint's grammar to compile
    max_top_logprobs: int = 20  # alternatives per token (the model services' own bound is 20)


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_stop_strings=int(args.max_stop_strings),
        max_stop_bytes=int(args.max_stop_bytes),
        max_prediction_bytes=int(args.max_prediction_bytes),
        max_grammar_bytes=int(args.max_grammar_bytes),
        grammar_compile_s=float(args.grammar_compile_s),
        max_top_logprobs=int(args.max_top_logprobs),
    )

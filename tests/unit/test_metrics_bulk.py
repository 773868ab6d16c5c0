"""orchestrator.api.metrics.observe_all: a generation's rounds observed at once, as one by one."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from orchestrator.api.metrics import observe_all

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def _exposition(feed) -> dict[str, float]:
    registry = CollectorRegistry()
    histogram = Histogram("h_seconds", "h", ["phase"], buckets=BUCKETS, registry=registry)
    feed(histogram.labels("target"))
    lines = generate_latest(registry).decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines
                                      if line.startswith("h_seconds") and "_created" not in line)}


def test_observing_all_at_once_gives_the_exposition_of_one_by_one():
    rng = random.Random(7)
    # Values on every bucket boundary (le is inclusive), between them, past the last, and zero.
    values = [*BUCKETS, 0.0, 3.0, *(rng.expovariate(40) for _ in range(500))]

    def one_by_one(h):
        for v in values:
            h.observe(v)

    bulk = _exposition(lambda h: observe_all(h, values))
    single = _exposition(one_by_one)
    assert bulk.keys() == single.keys()
    for key, value in single.items():
        assert abs(bulk[key] - value) <= 1e-9 * max(1.0, abs(value)), key
    assert single['h_seconds_bucket{le="0.001",phase="target"}'] >= 2  # the boundary value counted there
    assert single['h_seconds_count{phase="target"}'] == len(values)


def test_a_wrong_bucket_rule_would_show():
    """The control: off-by-one bucketing (bisect_right: le taken as exclusive) differs on the bounds."""
    import bisect

    values = list(BUCKETS)
    exclusive = sorted(bisect.bisect_right(BUCKETS, v) for v in values)
    inclusive = sorted(bisect.bisect_left(BUCKETS, v) for v in values)
    assert exclusive != inclusive
    assert _exposition(lambda h: observe_all(h, values))['h_seconds_bucket{le="0.001",phase="target"}'] == 1


def test_nothing_to_observe_changes_nothing():
    assert _exposition(lambda h: observe_all(h, [])) == _exposition(lambda h: None)

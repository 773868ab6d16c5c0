"""The call-wait micro-benchmark runs end to end: every way of waiting on a round's call is timed."""
from __future__ import annotations

import re

from benchmarks.micro import call_wait


def test_each_way_of_waiting_is_timed() -> None:
    lines = call_wait.main(["--sessions", "4", "--rounds", "20", "--repeats", "1"])
    rows = {m.group(1): float(m.group(2)) for line in lines if (m := re.match(r"\s+(\w+)\s+([\d.]+)$", line))}
    assert set(rows) == set(call_wait.WAYS)
    assert all(us > 0 for us in rows.values()), rows  # a call that cost nothing was not made

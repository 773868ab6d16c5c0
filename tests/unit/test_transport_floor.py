"""The transport floor micro-benchmark runs end to end: an echo server process, each transport timed."""
from __future__ import annotations

import re

from benchmarks.micro import transport_floor


def test_each_transport_is_timed_against_a_live_echo_server() -> None:
    lines = transport_floor.main(["--messages", "40", "--repeats", "1", "--bytes", "512"])
    rows = {m.group(1): [float(x) for x in m.groups()[1:]] for line in lines
            if (m := re.match(r"(grpc stream|grpc unary|socket)\s+([\d.]+) µs\s+([\d.]+) µs\s+([\d.]+) µs", line))}
    assert set(rows) == {"grpc stream", "grpc unary", "socket"}
    for kind, (rtt, client, server) in rows.items():
        assert rtt > 0, kind  # an exchange that took no time was not an exchange
        assert client >= 0 and server >= 0, kind

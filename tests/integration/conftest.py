"""One module-spanning stack (tiny target + tiny draft + orchestrator, real Redis) for the integration tests."""
from __future__ import annotations

import pytest

from specdec.runtime import procs
from tests.integration.stack import Stack


@pytest.fixture(scope="session")
def stack(tiny_pair, tmp_path_factory) -> Stack:
    """Target and draft registered in Redis under a private prefix; the orchestrator discovers them."""
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("logs"))
    try:
        s.target_metrics_port = procs.free_port()
        s.start_service("target", "target", target_dir, extra=("--metrics-port", str(s.target_metrics_port)))
        s.draft_metrics_port = procs.free_port()
        s.start_service("draft", "draft", draft_dir, extra=("--metrics-port", str(s.draft_metrics_port)))
        s.metrics_port = procs.free_port()
        s.start_orchestrator("orch", target_dir, extra=("--metrics-port", str(s.metrics_port)))
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def client(stack):
    from client import Client

    with Client(stack.addresses["orch"], timeout=120) as c:
        yield c

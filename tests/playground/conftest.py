"""One stack for the playground tests: tiny target + tiny draft + orchestrator (real Redis),
and `python -m gateway` with the playground on, started as separate processes."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.runtime import procs
from tests.integration.stack import ENV, Stack, wait_http
from tests.playground import browser as chromium

# A quota far above what the per-step tests spend: they check what each run charges.
BIG_QUOTA = 100_000


def start_gateway(stack: Stack, name: str, *flags: str) -> str:
    """`python -m gateway` in front of the stack's orchestrator; returns its base URL."""
    port = procs.free_port()
    proc = procs.start(["python", "-m", "gateway", "--orchestrator", stack.addresses["orch"],
                        "--port", str(port), *flags], env=ENV, log_path=stack.logs / f"{name}.log")
    stack.procs[name] = proc  # stopped by pid with the rest
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", proc)
    return base


@pytest.fixture(scope="package")
def pg(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("playground-logs"))
    try:
        metrics = procs.free_port()
        stack.start_service("target", "target", target_dir, extra=("--metrics-port", str(metrics)))
        stack.start_service("draft", "draft", draft_dir)
        stack.start_orchestrator("orch", target_dir)
        base = start_gateway(stack, "gateway", "--playground-passes-per-minute", str(BIG_QUOTA))
        yield SimpleNamespace(stack=stack, base=base, target_metrics=metrics,
                              target_dir=Path(target_dir), draft_dir=Path(draft_dir))
    finally:
        stack.stop()


@pytest.fixture(scope="package")
def grpc_client(pg):
    from client import Client

    with Client(pg.stack.addresses["orch"], timeout=120) as c:
        yield c


@pytest.fixture(scope="package")
def tokenizer(pg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pg.target_dir)


@pytest.fixture(scope="package")
def chrome():
    reason = chromium.missing()
    if reason:
        pytest.skip(f"browser tests skipped: {reason}")
    with chromium.browser() as context:
        yield context


@pytest.fixture
def page_at(chrome):
    """open(base) -> a fresh page on /playground with every other origin refused;
    afterwards, no request may have tried to leave the gateway."""
    opened = []

    def open_page(base: str, **emulate):
        refused = chromium.only_origin(chrome, base)
        page = chrome.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        if emulate:
            page.emulate_media(**emulate)
        page.goto(f"{base}/playground")
        page.wait_for_selector("#quota[data-remaining]")
        opened.append((page, refused, errors))
        return page

    yield open_page
    for page, refused, errors in opened:
        page.close()
        assert not refused, f"the page tried to reach other origins: {refused}"
        assert not errors, f"JavaScript errors on the page: {errors}"
    chrome.unroute("**/*")

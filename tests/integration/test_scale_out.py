"""Orchestrators scaled out over one fleet: streams spread over them, by the client and the gateway.

One target, two orchestrator processes on it (one Redis prefix, each with its own metrics), and a
gateway in front of both. Which orchestrator ran a stream is read from its own
`specdec_requests_total` for Generate, not from the client's word; every greedy text is compared
with target-only decoding through one orchestrator.
"""
from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest

from client import Client
from specdec.runtime import procs
from tests.integration.stack import Stack, post_json

PROMPT = "The cat sat on the mat and the dog"
OPTIONS = dict(max_new_tokens=24)
# A Generate call, or a generation on a GenerateMany stream (the gateway's, by default).
GENERATE = tuple(f'specdec_requests_total{{code="OK",method="/specdec.v1.Orchestrator/{m}"}} '
                 for m in ("Generate", "GenerateMany"))


def generated(port: int) -> int:
    """Generations an orchestrator finished with OK, from its /metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in body.splitlines() if line.startswith(GENERATE))


@pytest.fixture(scope="module")
def fleet(tiny_pair, tmp_path_factory):
    target_dir, _ = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("scale-out"))
    metrics = {}
    try:
        stack.start_service("target", "target", target_dir)
        for name in ("orchA", "orchB"):
            metrics[name] = procs.free_port()
            stack.start_orchestrator(name, target_dir, extra=("--metrics-port", str(metrics[name])))
        with Client(stack.addresses["orchA"], timeout=120) as c:
            reference = c.complete(PROMPT, proposer="none", **OPTIONS)
        assert len(reference.token_ids) == OPTIONS["max_new_tokens"]
        yield SimpleNamespace(stack=stack, metrics=metrics, reference=reference,
                              addresses=[stack.addresses["orchA"], stack.addresses["orchB"]])
    finally:
        stack.stop()


def counts(fleet) -> dict[str, int]:
    return {name: generated(port) for name, port in fleet.metrics.items()}


def served_since(fleet, before: dict[str, int]) -> dict[str, int]:
    after = counts(fleet)
    return {name: after[name] - before[name] for name in after}


def test_spread_streams_go_to_each_orchestrator_in_turn(fleet):
    before = counts(fleet)
    with Client(fleet.addresses, timeout=120, spread=True) as c:
        streams = [c.generate(PROMPT, **OPTIONS) for _ in range(4)]
        assert [s.address for s in streams] == fleet.addresses * 2
        texts = ["".join(chunk.text for chunk in s) for s in streams]
    assert texts == [fleet.reference.text] * 4
    assert served_since(fleet, before) == {"orchA": 2, "orchB": 2}


def test_without_spread_every_stream_goes_to_the_current_orchestrator(fleet):
    before = counts(fleet)
    with Client(fleet.addresses, timeout=120) as c:
        texts = [c.complete(PROMPT, **OPTIONS).text for _ in range(3)]
    assert texts == [fleet.reference.text] * 3
    assert served_since(fleet, before) == {"orchA": 3, "orchB": 0}


def test_a_spread_stream_on_a_dead_address_resumes_on_the_next(fleet):
    dead = f"127.0.0.1:{procs.free_port()}"  # nothing listens there
    before = counts(fleet)
    with Client([dead, *fleet.addresses], timeout=120, spread=True) as c:
        streams = [c.generate(PROMPT, **OPTIONS) for _ in range(3)]
        texts = ["".join(chunk.text for chunk in s) for s in streams]
        # The one that started on the dead address went on to orchA; the others ran where they began.
        assert [s.address for s in streams] == [fleet.addresses[0], *fleet.addresses]
    assert texts == [fleet.reference.text] * 3
    assert served_since(fleet, before) == {"orchA": 2, "orchB": 1}


@pytest.mark.parametrize("spread", [True, False])
def test_the_gateway_spreads_streams_over_its_orchestrators(fleet, spread):
    stack = fleet.stack
    base = stack.start_gateway("orchA,orchB", () if spread else ("--no-spread",))
    try:
        before = counts(fleet)
        texts = []
        for _ in range(4):
            status, reply = post_json(f"{base}/v1/completions", {
                "model": "specdec", "prompt": PROMPT, "max_tokens": OPTIONS["max_new_tokens"],
                "temperature": 0})
            assert status == 200, reply
            texts.append(reply["choices"][0]["text"])
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as page:
            assert page.status == 200  # the side calls reach an orchestrator of the list
    finally:
        stack.stop_one("gateway")
    assert texts == [fleet.reference.text] * 4  # greedy: target-only's text from either orchestrator
    assert served_since(fleet, before) == ({"orchA": 2, "orchB": 2} if spread else {"orchA": 4, "orchB": 0})

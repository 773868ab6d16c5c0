"""Bounded work per request, on a real orchestrator (tiny models, real Redis): every bound is an
INVALID_ARGUMENT naming the field, the limit and its flag; a constraint counts in the request's
bytes; a grammar is compiled once per request (n choices included), within --grammar-compile-s,
and kept; n counts n streams; Check and Predict take a target slot."""
from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from client import build_request
from specdec.runtime import procs
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def bounded(stack, tiny_pair):
    """An orchestrator of its own with small bounds, on the shared stack's target and draft."""
    metrics = procs.free_port()
    address = stack.start_orchestrator("bounded", tiny_pair[0], extra=(
        "--metrics-port", str(metrics), "--max-top-logprobs", "5", "--max-request-bytes", "8192",
        "--max-streams-per-tenant", "4", "--rate-per-tenant", "0", "--target-capacity", "3",
        "--admission-wait-s", "0.1", "--grammar-compile-s", "0.001"))
    channel = grpc.insecure_channel(address)
    yield orchestrator_pb2_grpc.OrchestratorStub(channel), metrics
    channel.close()
    stack.stop_one("bounded")


def _generate(stub, **kw) -> list[pb.GenerateResponse]:
    return list(stub.Generate(build_request(PROMPT, **kw), timeout=60))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def _compiles(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("specdec_grammar_compiles_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("kw,message", [
    ({"stop": [f"s{i}" for i in range(33)]},
     "stop: 33 stop strings, above this server's limit of 32 (--max-stop-strings)"),
    ({"stop": ["x" * 300] * 8}, "stop: 2400 bytes of stop strings, above this server's limit of 2048 "
                                "(--max-stop-bytes)"),
    ({"prediction": "é" * 140_000}, "prediction: 280000 bytes, above this server's limit of 262144 "
                                    "(--max-prediction-bytes)"),
    ({"regex": "a" * 70_000}, "constraint.regex: 70000 bytes, above this server's limit of 65536 "
                              "(--max-grammar-bytes)"),
    ({"logprobs": True, "top_logprobs": 6}, "top_logprobs: 6 is above this server's limit of 5 "
                                            "(--max-top-logprobs)"),
])
def test_each_bound_is_invalid_argument_naming_it(bounded, kw, message):
    err = _refused(lambda: _generate(bounded[0], max_new_tokens=4, **kw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == message


def test_a_constraint_counts_in_the_request_bytes(bounded):
    pattern = "(" + "|".join(f"w{i}" for i in range(2000)) + ")"  # ~10 kB: over --max-request-bytes
    err = _refused(lambda: _generate(bounded[0], max_new_tokens=4, regex=pattern))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("max_request_bytes:")


def test_a_grammar_is_compiled_once_within_its_bound_and_kept(bounded):
    stub, metrics = bounded
    grammar = "start: " + " | ".join(f'"word{i}"' for i in range(600))  # ~7 kB of Lark
    before = _compiles(metrics)
    err = _refused(lambda: _generate(stub, max_new_tokens=4, lark=grammar))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("constraint.lark: not compiled within 0.001 s (--grammar-compile-s); "
                             "simplify the grammar")
    deadline = time.monotonic() + 30  # the compile goes on off the loop, and is kept
    while _compiles(metrics).get("compiled", 0) == before.get("compiled", 0):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    responses = _generate(stub, max_new_tokens=6, lark=grammar, n=3, temperature=1.0, seed=7)
    texts = {}
    for r in responses:
        if r.HasField("chunk"):
            texts[r.chunk.index] = texts.get(r.chunk.index, "") + r.chunk.text
    assert sorted(texts) == [0, 1, 2] and all(t.startswith("word") for t in texts.values())
    after = _compiles(metrics)
    # One compile for the request, one lookup (the kept grammar) for its three choices.
    assert after.get("compiled", 0) - before.get("compiled", 0) == 1
    assert after.get("cached", 0) - before.get("cached", 0) == 1


def test_n_counts_n_streams_against_the_tenant(bounded):
    err = _refused(lambda: _generate(bounded[0], max_new_tokens=2, n=5))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("max_streams_per_tenant: 4 concurrent streams per tenant "
                                    "(this call runs 5 streams)")
    assert len([r for r in _generate(bounded[0], max_new_tokens=2, n=3) if r.HasField("stats")]) == 3


def test_check_and_predict_take_a_target_slot(bounded):
    stub = bounded[0]
    streaming: set[int] = set()

    def hold() -> None:  # n = 3 streams fill the target's 3 slots
        request = build_request(PROMPT, max_new_tokens=400, proposer="none", ignore_eos=True, n=3)
        for response in stub.Generate(request, timeout=120):
            streaming.add(response.chunk.index)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while len(streaming) < 3:  # each choice holds its slot once it streams
            assert time.monotonic() < deadline and holder.is_alive()
            time.sleep(0.01)
        calls = (lambda: stub.Check(pb.CheckRequest(prompt=PROMPT, guess=" mat"), timeout=30),
                 lambda: stub.Predict(pb.PredictRequest(text=PROMPT), timeout=30))
        for call in calls:
            err = _refused(call)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.details().startswith("target_capacity:")
    finally:
        holder.join(120)
    assert stub.Check(pb.CheckRequest(prompt=PROMPT, guess=" mat"), timeout=30).positions
    assert stub.Predict(pb.PredictRequest(text=PROMPT), timeout=30).tokens


def test_refused_requests_count_against_the_tenants_rate(stack, tiny_pair):
    """A client spamming requests a bound refuses is rate-limited like any other (each refusal
    still costs the orchestrator a message to parse)."""
    address = stack.start_orchestrator("rated", tiny_pair[0], extra=(  # a token per 100 s: none comes back
        "--rate-per-tenant", "0.01", "--burst-per-tenant", "3"))  # while the 6 calls run, however slowly
    try:
        with grpc.insecure_channel(address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            stops = [f"s{i}" for i in range(33)]
            codes = [_refused(lambda: _generate(stub, max_new_tokens=2, stop=stops)).code() for _ in range(6)]
    finally:
        stack.stop_one("rated")
    assert codes[:3] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert codes[3:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3

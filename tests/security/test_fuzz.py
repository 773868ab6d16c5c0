"""Property-based fuzz of every RPC of every service: random field values and raw garbage bytes.

Only documented statuses may come back (never UNKNOWN or INTERNAL), every server
stays up, and a normal request afterwards returns the same text as before.
Generate's fuzz sets every field that makes the orchestrator work or keep state:
constraints (valid, broken and over --max-grammar-bytes), logprobs and top_logprobs,
stop lists past --max-stop-strings and --max-stop-bytes, predictions past
--max-prediction-bytes, keep_session, resume_from and delivered, min_tokens and
stop_token_ids.
The CI budget is about 2,100 requests (~2 minutes on the tiny models);
SPECDEC_FUZZ_EXAMPLES=N runs about N instead.
"""
from __future__ import annotations

import collections
import os

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.runtime import procs
from specdec.v1 import common_pb2, model_pb2
from specdec.v1 import orchestrator_pb2 as pb
from tests.integration.stack import Stack

BUDGET = {"Score": 300, "Propose": 300, "Release": 150, "Generate": 450, "Check": 250,
          "Predict": 150, "EndSession": 150, "raw": 650}  # 2,400 requests
SCALE = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "0")) / sum(BUDGET.values()) or 1.0
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
METHODS = {
    "Score": ("target", "/specdec.v1.TargetService/Score"),
    "Propose": ("draft", "/specdec.v1.DraftService/Propose"),
    "Release": ("target", "/specdec.v1.TargetService/Release"),
    "ReleaseDraft": ("draft", "/specdec.v1.DraftService/Release"),
    "GetInfo": ("target", "/specdec.v1.TargetService/GetInfo"),
    "GetInfoDraft": ("draft", "/specdec.v1.DraftService/GetInfo"),
    "Generate": ("orch", "/specdec.v1.Orchestrator/Generate"),
    "Check": ("orch", "/specdec.v1.Orchestrator/Check"),
    "Predict": ("orch", "/specdec.v1.Orchestrator/Predict"),
    "EndSession": ("orch", "/specdec.v1.Orchestrator/EndSession"),
    "GetServedModel": ("orch", "/specdec.v1.Orchestrator/GetServedModel"),
}
SEEN: collections.Counter = collections.Counter()
BOUNDS = ("--max-stop-strings", "--max-stop-bytes", "--max-prediction-bytes", "--max-grammar-bytes",
          "--max-top-logprobs")
HIT: collections.Counter = collections.Counter()  # each bound's refusals
REFERENCE = {"prompt": "the quick brown fox", "max_new_tokens": 12}
BEFORE: dict[str, str] = {}  # the reference text before the fuzz


def examples(name: str) -> int:
    return max(1, int(BUDGET[name] * SCALE))


def fuzz_settings(name: str):
    return settings(max_examples=examples(name), deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_stack(tiny_pair, tmp_path_factory):
    """Tiny target + draft + orchestrator; no rate or stream limits (the fuzz is one tenant)."""
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("fuzz"))
    try:
        limits = ("--max-request-tokens", "600", "--max-sessions", "16")
        s.start_service("target", "target", target_dir, register=False, extra=limits)
        s.start_service("draft", "draft", draft_dir, register=False, extra=limits)
        s.start_orchestrator("orch", target_dir, targets=[s.addresses["target"]],
                             drafts=[s.addresses["draft"]],
                             extra=("--rate-per-tenant", "0", "--max-streams-per-tenant", "0",
                                    "--max-new-tokens-limit", "24", "--max-request-bytes", "20000",
                                    "--max-grammar-bytes", "2048", "--max-prediction-bytes", "4096"))
        channels = {name: grpc.insecure_channel(address) for name, address in s.addresses.items()}
        yield s, channels
        for channel in channels.values():
            channel.close()
    finally:
        s.stop()


def raw_call(channels, method: str, payload: bytes) -> grpc.StatusCode:
    """One call with `payload` as the serialized request; the status code it ends with."""
    where, path = METHODS[method]
    channel = channels[where]
    try:
        if method == "Generate":
            for _ in channel.unary_stream(path)(payload, timeout=60):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=60)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED, f"{method}: {code.name}: {exc.details()}"
        assert "Error" not in (exc.details() or ""), exc.details()  # no exception class names
        HIT.update(b for b in BOUNDS if f"({b})" in (exc.details() or ""))
    SEEN[(method, code.name)] += 1
    return code


def reference_text(channels) -> str:
    from client import build_request

    request = build_request(REFERENCE["prompt"], max_new_tokens=REFERENCE["max_new_tokens"])
    return "".join(r.chunk.text for r in channels["orch"].unary_stream(
        "/specdec.v1.Orchestrator/Generate", request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.GenerateResponse.FromString)(request, timeout=60)
        if r.HasField("chunk"))


# ------------------------------------------------------------------ strategies

u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-2**31, 2**31 - 1)
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
small_float = st.one_of(f32, st.floats(0, 2, width=32), st.sampled_from([0.0, 1e-40, 1e-7, 1e-6, 1.0]))
session_ids = st.one_of(st.sampled_from(["s1", "s2", "s3"]), st.text(max_size=300))
vocab_tokens = st.lists(st.integers(0, 400), max_size=40)
any_tokens = st.one_of(vocab_tokens, st.lists(i32, max_size=20), st.lists(st.integers(0, 300), min_size=590, max_size=640))


@st.composite
def sampling(draw):
    msg = common_pb2.SamplingParams(temperature=draw(small_float), top_k=draw(i32), min_p=draw(small_float))
    if draw(st.booleans()):
        msg.top_p = draw(small_float)
    return msg


@st.composite
def model_request(draw, cls):
    if draw(st.booleans()):  # well-formed apart from the sampling values: the compute paths
        msg = cls(session_id=draw(st.sampled_from(["v1", "v2"])), cache_position=0,
                  tokens=draw(st.lists(st.integers(0, 380), min_size=2, max_size=30)),
                  k=draw(st.integers(0, 1)), output_mode=draw(st.integers(0, 2)))
    else:
        msg = cls(session_id=draw(session_ids), cache_position=draw(st.one_of(st.integers(0, 50), u32)),
                  prefix_hash=draw(st.integers(0, 2**64 - 1)), tokens=draw(any_tokens),
                  k=draw(st.one_of(st.integers(0, 40), u32)), output_mode=draw(st.integers(-1, 4)))
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling()))
    if cls is model_pb2.ProposeRequest:
        msg.seed = draw(st.integers(0, 2**64 - 1))
        msg.p_min = draw(small_float)
    return msg


text = st.one_of(st.text(max_size=60), st.sampled_from(["", "hello world", "\x00", "\ud7ff" * 3]),
                 st.text(min_size=5000, max_size=6000))


SCHEMAS = ['{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
           '{"type": "string", "maxLength": 3}', '{"enum": ["x", "y"]}', "{not json", "[]", "3",
           '{"type": "nonsense"}', '{"$ref": "#/nowhere"}']
REGEXES = ["[a-z]{1,4}", "(yes|no)", "[0-9]+", "[", "((((", "a{99999}", "\\", "$^"]
LARKS = ['start: "x" | "y"', "start: /[0-9]+/", "start: nothing", "start: start", "%%%", "start:"]
GOOD = {"json_schema": SCHEMAS[:3], "regex": REGEXES[:3], "lark": LARKS[:2]}
# Over 2048 bytes: a short random piece repeated (a 2,100-character random text costs hypothesis
# more entropy than it gives most examples, so it was drawn rarely, in one run never).
long_text = st.builds(lambda piece, n: (piece * n)[:n], st.text(min_size=1, max_size=12), st.integers(2100, 2500))
grammar_text = st.one_of(st.text(max_size=40), long_text)


@st.composite
def constraint(draw, valid: bool) -> pb.Constraint:
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "lark"]))
    if kind == "json_object":
        return pb.Constraint(json_object=draw(st.booleans()))
    if valid:
        return pb.Constraint(**{kind: draw(st.sampled_from(GOOD[kind]))})
    known = {"json_schema": SCHEMAS, "regex": REGEXES, "lark": LARKS}[kind]
    return pb.Constraint(**{kind: draw(st.one_of(st.sampled_from(known), grammar_text))})


# A few stop strings, past --max-stop-strings (32), or past --max-stop-bytes (2048).
stops = st.one_of(st.lists(st.text(min_size=1, max_size=3), max_size=3),
                  st.lists(st.text(min_size=1, max_size=4), min_size=30, max_size=40),
                  st.lists(st.text(min_size=300, max_size=400), min_size=5, max_size=8))
predictions = st.one_of(st.just(""), st.text(max_size=40), st.text(min_size=4090, max_size=4200))


@st.composite
def delivered(draw) -> list[pb.Delivered]:
    return [pb.Delivered(index=draw(st.one_of(st.integers(0, 3), u32)),
                         token_ids=draw(st.one_of(vocab_tokens, st.lists(i32, max_size=5))),
                         finished=draw(st.booleans()))
            for _ in range(draw(st.integers(0, 3)))]


def with_state_and_work(draw, msg: pb.GenerateRequest, valid: bool) -> pb.GenerateRequest:
    """The fields that make the orchestrator compile, index, log-prob or keep state, each half the
    time: `valid` ones (the work runs) or anything (the checks run)."""
    if draw(st.booleans()):
        msg.constraint.CopyFrom(draw(constraint(valid)))
    if draw(st.booleans()):
        msg.logprobs = valid or draw(st.booleans())
        msg.top_logprobs = draw(st.integers(0, 5) if valid else st.one_of(st.integers(0, 20), st.integers(21, 40), u32))
    if draw(st.booleans()):
        msg.keep_session = draw(st.booleans())
        if not valid:  # a resume of a made-up session, with made-up tokens
            msg.resume_from = draw(st.one_of(st.just(0), st.integers(0, 60), u32))
            msg.delivered.extend(draw(delivered()))
    if draw(st.booleans()):
        msg.min_tokens = draw(st.integers(0, msg.max_new_tokens) if valid else st.one_of(st.integers(0, 12), u32))
        msg.stop_token_ids.extend(draw(st.lists(st.integers(0, 380) if valid else i32, max_size=4)))
    return msg


@st.composite
def generate_request(draw):
    if draw(st.booleans()):  # well-formed apart from sampling, stops and guess: the loop runs
        msg = pb.GenerateRequest(
            prompt=draw(st.text(min_size=1, max_size=40).filter(str.strip)),
            max_new_tokens=draw(st.integers(1, 12)), seed=draw(st.integers(0, 2**64 - 1)),
            stop=draw(st.one_of(stops, *[st.lists(st.text(min_size=1, max_size=3), max_size=2)] * 4)),
            proposer=draw(st.integers(0, 4)), k=draw(st.integers(0, 6)),
            guess=draw(st.text(min_size=1, max_size=20)), round_tokens=draw(st.booleans()),
            max_target_passes=draw(st.one_of(st.integers(0, 4), u32)),
            prediction=draw(st.one_of(predictions, st.just(""), st.just(""))), n=draw(st.integers(0, 3)))
        if draw(st.booleans()):
            msg.sampling.CopyFrom(draw(sampling()))
        return with_state_and_work(draw, msg, valid=True)
    msg = pb.GenerateRequest(
        prompt=draw(text), max_new_tokens=draw(st.one_of(st.integers(0, 30), u32)),
        seed=draw(st.integers(0, 2**64 - 1)), stop=draw(st.one_of(stops, st.lists(st.text(max_size=5), max_size=3))),
        proposer=draw(st.integers(-1, 6)), k=draw(st.one_of(st.integers(0, 20), u32)),
        guess=draw(st.text(max_size=30)), session_id=draw(session_ids), strict=draw(st.booleans()),
        prediction=draw(predictions), n=draw(st.one_of(st.integers(0, 20), u32)))
    with_state_and_work(draw, msg, valid=False)
    if draw(st.booleans()):
        msg.messages.extend(pb.ChatMessage(role=draw(st.sampled_from(["user", "system", "assistant", "", "tool", "x" * 50])),
                                           content=draw(st.text(max_size=40)))
                            for _ in range(draw(st.integers(0, 4))))
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling()))
    return msg


@st.composite
def check_request(draw):
    msg = pb.CheckRequest(prompt=draw(text), guess=draw(st.one_of(st.text(max_size=80), text)))
    if draw(st.booleans()):
        msg.messages.extend(pb.ChatMessage(role=draw(st.sampled_from(["user", "bogus", ""])),
                                           content=draw(st.text(max_size=40)))
                            for _ in range(draw(st.integers(0, 3))))
    return msg


@st.composite
def predict_request(draw):
    msg = pb.PredictRequest(text=draw(text), top_k=draw(st.one_of(st.integers(0, 25), u32)),
                            distributions=draw(st.booleans()))
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling()))
    return msg


garbage = st.one_of(st.binary(max_size=200), st.binary(min_size=1000, max_size=4000),
                    st.sampled_from([b"\x0a\x02\xff\xfe", b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 10,
                                     b"\x22\x05\x01\x02", b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"]))


# ------------------------------------------------------------------ tests


def test_reference_before(fuzz_stack) -> None:
    BEFORE["text"] = reference_text(fuzz_stack[1])


@fuzz_settings("Score")
@given(msg=model_request(model_pb2.ScoreRequest))
def test_score(fuzz_stack, msg) -> None:
    raw_call(fuzz_stack[1], "Score", msg.SerializeToString())


@fuzz_settings("Propose")
@given(msg=model_request(model_pb2.ProposeRequest))
def test_propose(fuzz_stack, msg) -> None:
    raw_call(fuzz_stack[1], "Propose", msg.SerializeToString())


@fuzz_settings("Release")
@given(session=session_ids, draft=st.booleans())
def test_release(fuzz_stack, session, draft) -> None:
    payload = common_pb2.ReleaseRequest(session_id=session).SerializeToString()
    raw_call(fuzz_stack[1], "ReleaseDraft" if draft else "Release", payload)


# One request per bound, well formed apart from that bound, always run besides the random draws:
# an over-limit field drawn among random ones is often refused first for another field, so a
# bound reached by chance alone went unreached in some runs (--max-grammar-bytes, once in 2,400).
def over_one_bound(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="the quick brown fox", max_new_tokens=4, **fields)


BOUND_EXAMPLES = (
    over_one_bound(stop=["s"] * 33),
    over_one_bound(stop=["x" * 500] * 5),
    over_one_bound(prediction="p" * 4100),
    over_one_bound(constraint=pb.Constraint(regex="a" * 2100)),
    over_one_bound(logprobs=True, top_logprobs=21),
)


def with_bound_examples(test):
    for msg in BOUND_EXAMPLES:
        test = example(msg=msg)(test)
    return test


@fuzz_settings("Generate")
@with_bound_examples
@given(msg=generate_request())
def test_generate(fuzz_stack, msg) -> None:
    raw_call(fuzz_stack[1], "Generate", msg.SerializeToString())


@fuzz_settings("Check")
@given(msg=check_request())
def test_check(fuzz_stack, msg) -> None:
    raw_call(fuzz_stack[1], "Check", msg.SerializeToString())


@fuzz_settings("Predict")
@given(msg=predict_request())
def test_predict(fuzz_stack, msg) -> None:
    raw_call(fuzz_stack[1], "Predict", msg.SerializeToString())


@fuzz_settings("EndSession")
@given(session=session_ids)
def test_end_session(fuzz_stack, session) -> None:
    raw_call(fuzz_stack[1], "EndSession", pb.EndSessionRequest(session_id=session).SerializeToString())


@fuzz_settings("raw")
@given(method=st.sampled_from(sorted(METHODS)), payload=garbage)
def test_garbage_bytes(fuzz_stack, method, payload) -> None:
    raw_call(fuzz_stack[1], method, payload)


def test_servers_survive_and_answer_the_same(fuzz_stack) -> None:
    stack, channels = fuzz_stack
    for name, proc in stack.procs.items():
        assert proc.poll() is None, f"{name} exited: {procs.log_tail(proc)}"
    assert BEFORE.get("text") and reference_text(channels) == BEFORE["text"]
    total = sum(SEEN.values())
    print(f"\nfuzz: {total} requests; " + ", ".join(
        f"{m} {c}: {n}" for (m, c), n in sorted(SEEN.items())))
    print("bounds refused: " + ", ".join(f"{b} {HIT[b]}" for b in BOUNDS))
    if SCALE >= 1.0:
        assert total >= 2000
        assert all(HIT[b] for b in BOUNDS), HIT  # the fuzz reaches every bound

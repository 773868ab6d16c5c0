"""Score's grammar masks and log-probabilities on a real target process (tiny model).

Against the model loaded in the test process: the masked argmax, the masked and
renormalised distributions, and the log-probabilities (of the drafted tokens,
of the argmax, the top n) to 1e-4; and every malformed field gets
INVALID_ARGUMENT naming it.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from specdec.core import masks
from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.v1 import common_pb2
from specdec.runtime.wire import decode_probs
from tests.service.conftest import score, temperature

PROBS = common_pb2.OUTPUT_MODE_PROBS
TOL = 1e-4


def _reference_logits(reference, tokens: list[int], k: int) -> torch.Tensor:
    with torch.inference_mode():
        return reference[0](torch.tensor([tokens])).logits[0, -(k + 1):].float()  # [k + 1, vocab]


def _random_mask(rows: int, vocab: int, seed: int, keep: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, vocab)) < keep
    allowed[:, rng.integers(vocab)] = True  # never empty
    return allowed


def _wire(allowed: np.ndarray) -> common_pb2.TokenMasks:
    return common_pb2.TokenMasks(rows=allowed.shape[0], bits=masks.pack(allowed).astype("<i4").tobytes())


def test_pack_and_unpack_round_trip() -> None:
    allowed = _random_mask(3, 1000, seed=1)
    words = masks.pack(allowed)
    assert words.shape == (3, 32)
    assert torch.equal(masks.unpack(torch.from_numpy(words), 1000), torch.from_numpy(allowed))
    assert all(masks.allows(words[0], t) == bool(allowed[0, t]) for t in range(1000))
    assert not masks.unpack(torch.from_numpy(words), 1100)[:, 1024:].any()  # past the words: disallowed


@pytest.mark.parametrize("sampling", [None, temperature(0.8, top_k=50)], ids=["greedy", "t0.8-topk"])
def test_masked_scores_and_logprobs_match_the_model(target, tokenizer, reference, sampling) -> None:
    toks = tokenizer("Structured output keeps the target exact")["input_ids"]
    k = 4
    logits = _reference_logits(reference, toks, k)
    vocab = logits.shape[-1]
    allowed = _random_mask(k + 1, vocab, seed=7)
    # The drafted tokens: the masked argmax at two positions, something else at the others.
    kw = {"sampling": sampling} if sampling else {}
    got = score(target.stub, f"mask-{id(sampling)}", toks, 0, toks, k=k, output_mode=PROBS,
                allowed=_wire(allowed), logprobs=5, **kw)
    masked = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert list(got.argmax_ids) == masked.argmax(-1).tolist()
    assert all(allowed[i, t] for i, t in enumerate(got.argmax_ids))
    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k) if sampling else SamplingParams()
    p = probs_from_logits(masked, params)
    torch.testing.assert_close(decode_probs(got.probs), p, atol=1e-5, rtol=0)
    lp = torch.log_softmax(masked, -1) if params.greedy else torch.log(p)
    drafted = toks[-k:]
    want_drafted = [lp[i, t].item() for i, t in enumerate(drafted)]
    for a, b in zip(got.logprobs.drafted, want_drafted):
        assert (a == b == float("-inf")) or abs(a - b) < TOL
    assert np.allclose(got.logprobs.argmax, [lp[i, t].item() for i, t in enumerate(got.argmax_ids)], atol=TOL)
    assert got.logprobs.top_n == 5
    top = torch.topk(lp, 5, dim=-1)
    assert np.allclose(np.array(got.logprobs.top_logprobs).reshape(k + 1, 5), top.values.numpy(), atol=TOL)
    assert list(got.logprobs.top_ids[::5]) == got.argmax_ids[:]  # the most likely first


def test_without_a_mask_nothing_changes(target, tokenizer, reference) -> None:
    toks = tokenizer("Free text is not masked")["input_ids"]
    got = score(target.stub, "nomask", toks, 0, toks, k=2, logprobs=1)
    logits = _reference_logits(reference, toks, 2)
    assert list(got.argmax_ids) == logits.argmax(-1).tolist()
    assert np.allclose(got.logprobs.argmax, torch.log_softmax(logits, -1).max(-1).values.numpy(), atol=TOL)
    assert not score(target.stub, "nolp", toks, 0, toks, k=2).HasField("logprobs")


@pytest.mark.parametrize("field,kw", [
    ("allowed.rows", lambda v: {"allowed": common_pb2.TokenMasks(rows=2, bits=b"\xff" * (2 * masks.words_per_position(v) * 4))}),
    ("allowed.bits", lambda v: {"allowed": common_pb2.TokenMasks(rows=3, bits=b"\xff" * 12)}),
    ("allows no token", lambda v: {"allowed": common_pb2.TokenMasks(rows=3, bits=b"\x00" * (3 * masks.words_per_position(v) * 4))}),
    ("logprobs", lambda v: {"logprobs": 21}),
])
def test_bad_masks_and_logprobs_are_invalid_argument(target, tokenizer, reference, field, kw) -> None:
    toks = tokenizer("bad input")["input_ids"]
    vocab = reference[0].get_output_embeddings().weight.shape[0]
    with pytest.raises(grpc.RpcError) as err:
        score(target.stub, "bad-mask", toks, 0, toks, k=2, **kw(vocab))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()

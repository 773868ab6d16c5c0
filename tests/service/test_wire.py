"""specdec.runtime.wire: exact round trips of sampling parameters and distributions."""
from __future__ import annotations

import pytest
import torch

from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.runtime.errors import InvalidArgument
from specdec.v1 import common_pb2
from specdec.runtime.wire import decode_probs, encode_probs, sampling_from_proto, sampling_to_proto


def test_sampling_round_trip_and_defaults() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_from_proto(None).greedy
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)
    back = sampling_from_proto(sampling_to_proto(params))
    assert back.top_k == 5
    assert (back.temperature, back.top_p, back.min_p) == pytest.approx((0.7, 0.9, 0.05), rel=1e-6)
    assert not sampling_to_proto(SamplingParams()).HasField("top_p")


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"top_k": -1}, "sampling.top_k"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"min_p": 1.0}, "sampling.min_p"),
    ],
)
def test_bad_sampling_names_the_field(fields: dict, name: str) -> None:
    with pytest.raises(InvalidArgument, match=name):
        sampling_from_proto(common_pb2.SamplingParams(**fields))


@pytest.mark.parametrize(
    "params, sparse",
    [
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.8, top_k=7), True),
        (SamplingParams(temperature=1.0, top_p=0.5), True),
        (SamplingParams(), True),  # greedy rows are one-hot
    ],
)
def test_probs_round_trip_is_exact(params: SamplingParams, sparse: bool) -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 3
    probs = probs_from_logits(logits, params)  # [5, 1000]
    msg = encode_probs(probs)
    assert bool(msg.dense) != sparse
    back = decode_probs(common_pb2.Distributions.FromString(msg.SerializeToString()))
    assert back.dtype == torch.float32 and back.shape == probs.shape
    assert torch.equal(back, probs)


def test_empty_and_malformed_distributions() -> None:
    assert decode_probs(encode_probs(torch.zeros(0, 10))).shape == (0, 10)
    msg = encode_probs(probs_from_logits(torch.randn(2, 50), SamplingParams(temperature=1.0)))
    msg.dense = msg.dense[:-4]
    with pytest.raises(InvalidArgument, match="probs.dense"):
        decode_probs(msg)
    sparse = encode_probs(probs_from_logits(torch.randn(2, 50), SamplingParams()))
    sparse.ids = (100).to_bytes(4, "little") + sparse.ids[4:]
    with pytest.raises(InvalidArgument, match="probs.ids"):
        decode_probs(sparse)

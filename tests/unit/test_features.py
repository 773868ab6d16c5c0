"""The feature relay (orchestrator.proposers.features) and the features' wire encoding (specdec.runtime.wire)."""
from __future__ import annotations

import pytest
import torch

from orchestrator.proposers.features import FeatureRelay, RelayCache
from specdec.core.fingerprint import prefix_fingerprints
from specdec.runtime.errors import InvalidArgument
from specdec.v1 import common_pb2
from specdec.runtime.wire import decode_features, encode_features

DIM = 8
F16 = common_pb2.FEATURE_ENCODING_FLOAT16


def rows(first: int, n: int) -> common_pb2.Features:
    """Features whose every value is its absolute position (exact in fp16 below 2048)."""
    values = torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, DIM)
    return encode_features(values, F16, first)


def positions(features: common_pb2.Features) -> list[float]:
    return decode_features(features, DIM)[:, 0].tolist()


@pytest.mark.parametrize("encoding", [common_pb2.FEATURE_ENCODING_FLOAT16, common_pb2.FEATURE_ENCODING_FLOAT32,
                                      common_pb2.FEATURE_ENCODING_BFLOAT16])
def test_encodings_round_trip(encoding):
    x = torch.randn(5, DIM) * 10
    back = decode_features(encode_features(x, encoding, 3), DIM)
    tol = {common_pb2.FEATURE_ENCODING_FLOAT32: 0.0, common_pb2.FEATURE_ENCODING_FLOAT16: 1e-2,
           common_pb2.FEATURE_ENCODING_BFLOAT16: 1e-1}[encoding]
    assert back.shape == (5, DIM)
    assert float((back - x).abs().max()) <= tol * float(x.abs().max())
    if encoding == common_pb2.FEATURE_ENCODING_BFLOAT16:
        assert torch.equal(back, x.to(torch.bfloat16).float())  # the same rounding as torch's


def test_malformed_features_are_invalid_argument():
    good = rows(0, 2)
    with pytest.raises(InvalidArgument, match="dim"):
        decode_features(good, DIM + 1)
    with pytest.raises(InvalidArgument, match="bytes"):
        decode_features(common_pb2.Features(rows=2, dim=DIM, encoding=F16, data=b"\0" * 3), DIM)
    with pytest.raises(InvalidArgument, match="encoding"):
        decode_features(common_pb2.Features(rows=1, dim=DIM, encoding=99, data=b""), DIM)
    nan = encode_features(torch.full((1, DIM), float("nan")), F16)
    with pytest.raises(InvalidArgument, match="finite"):
        decode_features(nan, DIM)


def test_relay_keeps_only_committed_positions_and_serves_the_previous_position():
    relay = FeatureRelay(DIM)
    # Prefill of a 5-token prompt: rows 0..4, all committed and read.
    relay.absorb(rows(0, 5), fed_committed=5)
    assert relay.known == 5
    # Propose for the 6 committed tokens from position 0: zeros for token 0, then features 0..4.
    assert positions(relay.rows_for(0, 6)) == [0.0, 0, 1, 2, 3, 4]
    assert relay.rows_for(0, 7) is None  # the feature of position 5 is not known yet
    # A round: Score from position 5 with token 5 + 3 drafts (rows 5..8); 1 draft accepted:
    # positions 5 and 6 are committed and read, 7 and 8 were rejected drafts.
    relay.absorb(rows(5, 4), fed_committed=7)
    assert relay.known == 7
    assert positions(relay.rows_for(6, 2)) == [5.0, 6.0]
    # A resend from 0 (a target cache miss) replaces everything from its first position.
    relay.absorb(rows(0, 8), fed_committed=8)
    assert relay.known == 8 and positions(relay.rows_for(7, 2)) == [6.0, 7.0]
    assert relay.received == 2 * (5 + 4 + 8) * DIM and relay.sent == 2 * (6 + 2 + 2) * DIM


def test_a_gap_is_never_filled_with_later_rows():
    relay = FeatureRelay(DIM)
    relay.absorb(rows(0, 3), fed_committed=3)
    relay.absorb(rows(5, 2), fed_committed=7)  # positions 3, 4 missing: nothing after them is kept
    assert relay.known == 3


def test_relay_cache_checks_the_prefix():
    cache = RelayCache()
    tokens = [5, 6, 7, 8, 9]
    relay = FeatureRelay(DIM)
    relay.absorb(rows(0, 4), fed_committed=4)
    cache.keep("s", relay, prefix_fingerprints(tokens))
    same = cache.take("s", DIM, prefix_fingerprints(tokens + [1, 2]))  # the next turn extends the text
    assert same is relay and same.known == 4
    cache.keep("s", relay, prefix_fingerprints(tokens))
    other = cache.take("s", DIM, prefix_fingerprints([5, 6, 0, 8, 9, 1]))  # the history differs from token 2
    assert other is relay and other.known == 2
    assert cache.take("s", DIM, prefix_fingerprints(tokens)).known == 0  # taken once


def test_a_tree_scores_features_become_the_accepted_paths_rows():
    """A tree Score returns a row per token sent (2 committed, then 5 nodes); the relay keeps the
    committed rows and the accepted path's nodes' rows, in path order, as consecutive positions."""
    from orchestrator.round.hooks import _path_rows

    reply = rows(10, 7)  # positions 10, 11 committed; nodes 0..4 carry 12..16 as their values
    kept = _path_rows(reply, 5, (1, 3), FeatureRelay(DIM).width)
    assert (kept.first_position, kept.rows) == (10, 4)
    assert positions(kept) == [10.0, 11.0, 13.0, 15.0]
    relay = FeatureRelay(DIM)
    relay.absorb(rows(0, 10), 10)
    relay.absorb(kept, 13)  # the committed tokens the target read: 10 + 1 + the path's first 2
    assert relay.known == 13 and positions(relay.rows_for(11, 3)) == [10.0, 11.0, 13.0]
    assert _path_rows(rows(10, 7), 5, (), FeatureRelay(DIM).width).rows == 2  # nothing accepted

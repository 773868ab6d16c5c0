"""The feature relay of a feature draft: the target's hidden states, from Score to Propose.

A feature draft (an EAGLE-style head, ModelInfo.feature_dim > 0 on the draft)
reads, with each token at position p, the target's feature at p - 1 (its final
hidden state after the final norm). The target returns one feature per token
it is sent (ScoreRequest.features); this relay keeps, for the request, the
features of the committed positions the target has computed, in the wire's
encoding, and hands the draft the rows its next Propose needs.

Only features of committed tokens are kept: a round's Score returns rows for
its drafted tokens too, and the rows past the last accepted draft are dropped
with the rejected tokens, so the draft never reads a feature that does not
match the committed text. The relay holds positions [0, known); anything the
target is asked to skip must already be here, so the loop crops the target's
held length to `known` before a Score (after a resume on another orchestrator,
or a new turn, known is 0 and the first Score resends the prefix, which
returns its features with it).

Bytes on the wire are counted both ways: `received` (Score responses) and
`sent` (Propose requests).
"""
from __future__ import annotations

from specdec.errors import FailedPrecondition
from specdec.v1 import common_pb2

DEFAULT_ENCODING = common_pb2.FEATURE_ENCODING_FLOAT16


class FeatureRelay:
    """Features of a request's committed positions [0, known), as raw rows in one encoding."""

    def __init__(self, dim: int, encoding: int = DEFAULT_ENCODING):
        self.dim = dim
        self.encoding = encoding
        self.width = dim * (4 if encoding == common_pb2.FEATURE_ENCODING_FLOAT32 else 2)  # bytes per row
        self._data = bytearray()  # row p at [p * width, (p + 1) * width)
        self.received = 0  # feature bytes in Score responses
        self.sent = 0  # feature bytes in Propose requests

    @property
    def known(self) -> int:
        return len(self._data) // self.width

    def absorb(self, features: common_pb2.Features | None, fed_committed: int) -> None:
        """A Score's features (one row per token sent, from its cache position); keep the rows of
        positions below `fed_committed` (the committed tokens the target has now read)."""
        if features is None or not features.rows:
            return
        if features.dim != self.dim or features.encoding != self.encoding:
            raise FailedPrecondition(f"features: the target returned dim {features.dim} / encoding "
                                     f"{features.encoding}, expected {self.dim} / {self.encoding}")
        self.received += len(features.data)
        first = int(features.first_position)
        if first > self.known:
            return  # a gap (cannot happen while the target is cropped to `known`): keep what is contiguous
        keep = max(0, min(int(features.rows), fed_committed - first))
        del self._data[first * self.width:]
        self._data += features.data[:keep * self.width]

    def crop(self, length: int) -> None:
        """Keep positions [0, length) (the committed text got shorter: never in a turn, kept for safety)."""
        del self._data[length * self.width:]

    def rows_for(self, position: int, n_tokens: int) -> common_pb2.Features | None:
        """ProposeRequest.features for tokens at positions [position, position + n_tokens): the
        features at position - 1 .. position + n_tokens - 2 (a zero row for a token at 0);
        None if the relay lacks some."""
        if n_tokens <= 0:
            return common_pb2.Features(dim=self.dim, encoding=self.encoding)
        last = position + n_tokens - 1  # the feature of the position before the last token
        if last > self.known:
            return None
        lead = b"\0" * self.width if position == 0 else b""
        data = lead + bytes(self._data[max(position - 1, 0) * self.width:last * self.width])
        self.sent += len(data)
        return common_pb2.Features(first_position=position, rows=n_tokens, dim=self.dim,
                                   encoding=self.encoding, data=data)

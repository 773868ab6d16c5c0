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

from specdec.runtime.errors import FailedPrecondition
from specdec.v1 import common_pb2

DEFAULT_ENCODING = common_pb2.FEATURE_ENCODING_FLOAT16


class FeatureRelay:
    """Features of a request's committed positions [0, known), as raw rows in one encoding."""

    def __init__(self, dim: int, layers: tuple[int, ...] = (), encoding: int = DEFAULT_ENCODING):
        self.dim = dim
        self.layers = tuple(layers)  # ScoreRequest.feature_layers (an EAGLE-3 head's; () = the final state)
        self.encoding = encoding
        self.width = dim * (4 if encoding == common_pb2.FEATURE_ENCODING_FLOAT32 else 2)  # bytes per row
        self._data = bytearray()  # row p at [p * width, (p + 1) * width)
        self.received = 0  # feature bytes in Score responses
        self.sent = 0  # feature bytes in Propose requests

    @property
    def known(self) -> int:
        return len(self._data) // self.width

    @property
    def nbytes(self) -> int:
        return len(self._data)

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


class RelayCache:
    """The relays of multi-turn sessions between their turns, in this orchestrator's memory (LRU).

    A session's next turn on the same orchestrator starts with the features of
    its held prefix, so the target need not recompute them; on another
    orchestrator (or after eviction) the turn starts empty and the first Score
    resends the prefix. A kept relay is cut to the longest prefix its tokens
    share with the new turn's (by their prefix fingerprints) before use.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        from collections import OrderedDict

        self.max_bytes = max_bytes
        self._relays: OrderedDict[str, tuple[FeatureRelay, int]] = OrderedDict()
        self._bytes = 0

    def take(self, session_id: str, dim: int, prefix_fps, layers: tuple[int, ...] = ()) -> FeatureRelay:
        """The session's kept relay, cut to the longest prefix it shares with the turn's tokens
        (prefix_fps[i] = fingerprint of the first i), else a new one."""
        kept = self._relays.pop(session_id, None)
        if kept is None:
            return FeatureRelay(dim, layers)
        relay, fps = kept
        self._bytes -= relay.nbytes
        if relay.dim != dim or relay.layers != tuple(layers):
            return FeatureRelay(dim, layers)
        lo, hi = 0, min(relay.known, len(prefix_fps) - 1)  # fps[0] (the empty prefix) always matches
        while lo < hi:  # prefixes share their fingerprints up to where they diverge
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fps[mid] == prefix_fps[mid] else (lo, mid - 1)
        relay.crop(lo)
        relay.received = relay.sent = 0
        return relay

    def keep(self, session_id: str, relay: FeatureRelay, prefix_fps) -> None:
        """After a turn: keep the relay with the fingerprints of its tokens' prefixes."""
        if relay.known >= len(prefix_fps) or relay.nbytes > self.max_bytes:
            return
        self._relays[session_id] = (relay, list(prefix_fps[:relay.known + 1]))
        self._bytes += relay.nbytes
        while self._bytes > self.max_bytes and self._relays:
            _, (old, _) = self._relays.popitem(last=False)
            self._bytes -= old.nbytes

    def drop(self, session_id: str) -> None:
        kept = self._relays.pop(session_id, None)
        if kept is not None:
            self._bytes -= kept[0].nbytes

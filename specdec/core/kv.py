"""KV-cache bookkeeping: the length each cache is cropped to after a verdict.

Service contract (proto/specdec/v1/model.proto): a request with
`cache_position = n` crops the cache to its first n tokens, then appends the
request's tokens. Lengths here are absolute (a count of tokens from the start
of the sequence), never relative "drop the last j", so a retried request is
idempotent: cropping to n twice is the same as once.

One round, with c = committed_before tokens committed before it and k drafted:
- the draft, after Propose(k), holds c + k - 1 tokens: it sampled the last
  drafted token but never fed it back (and holds c when k == 0);
- the target, after Score, holds c + k: every committed token and every
  drafted one;
- the verdict accepts m drafted tokens and adds one extra token; c + m + 1
  tokens are now committed. The extra token has been fed to nobody.

So the target is cropped to c + m (its entries for the m accepted drafted tokens are
exactly right; those of rejected ones are dropped) and is next sent the extra
token. The draft is cropped to min(held, c + m): after a rejection that drops its
rejected entries; after full acceptance (m == k) that is c + k - 1, and it is next
sent TWO tokens, the last drafted token it never fed (the catch-up token) and
the bonus token. In every case the next request's tokens are
committed[length:], and its cache_position is that length.
"""
from __future__ import annotations

from collections.abc import Sequence


def crop_lengths(
    *,
    committed_before: int,
    n_drafted: int,
    n_accepted: int,
    draft_held: int,
    n_committed: int | None = None,
) -> tuple[int, int]:
    """Absolute cache lengths (target_len, draft_len) to crop to after a verdict.

    `draft_held` is the draft's reported cache length after Propose (0 if no
    draft model proposed this round). `n_committed` is how many of the round's
    m + 1 new tokens were actually committed after stopping rules (default
    m + 1); fewer (an EOS or the length limit inside the accepted run) lowers
    both lengths so no cache holds an uncommitted token.
    """
    if not 0 <= n_accepted <= n_drafted:
        raise ValueError(f"n_accepted must be in [0, n_drafted={n_drafted}], got {n_accepted}")
    if committed_before < 0 or draft_held < 0:
        raise ValueError("committed_before and draft_held must be >= 0")
    if n_committed is None:
        n_committed = n_accepted + 1
    if not 0 <= n_committed <= n_accepted + 1:
        raise ValueError(f"n_committed must be in [0, n_accepted + 1 = {n_accepted + 1}], got {n_committed}")
    valid = committed_before + min(n_accepted, n_committed)
    return valid, min(draft_held, valid)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (what of a cache is still valid for another)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

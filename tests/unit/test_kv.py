"""Keep-length arithmetic for the target and draft KV caches."""
from __future__ import annotations

import pytest

from specdec.core.kv import crop_lengths


def test_after_rejection_both_keep_committed_before_plus_accepted() -> None:
    # 10 committed, 4 drafted, 2 accepted: target holds 14, draft 13 -> both are cropped to 12.
    assert crop_lengths(committed_before=10, n_drafted=4, n_accepted=2, draft_held=13) == (12, 12)


def test_full_acceptance_draft_lacks_its_last_drafted_token() -> None:
    # All 4 accepted: 15 committed; target keeps 14, draft keeps 13 and is fed 2 tokens next.
    t, d = crop_lengths(committed_before=10, n_drafted=4, n_accepted=4, draft_held=13)
    assert (t, d) == (14, 13)
    committed = list(range(15))
    assert committed[t:] == [14]  # the next request's tokens: the bonus token
    assert committed[d:] == [13, 14]  # the catch-up token, then the bonus token


def test_no_draft_round() -> None:
    assert crop_lengths(committed_before=10, n_drafted=0, n_accepted=0, draft_held=0) == (10, 0)
    assert crop_lengths(committed_before=10, n_drafted=0, n_accepted=0, draft_held=10) == (10, 10)


def test_clipped_round_keeps_only_committed_tokens() -> None:
    # 4 accepted but EOS at the 2nd new token: only 2 committed.
    assert crop_lengths(committed_before=10, n_drafted=4, n_accepted=4, draft_held=13, n_committed=2) == (12, 12)


def test_idempotent_absolute_lengths() -> None:
    args = dict(committed_before=7, n_drafted=3, n_accepted=1, draft_held=9)
    assert crop_lengths(**args) == crop_lengths(**args)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="n_accepted"):
        crop_lengths(committed_before=1, n_drafted=2, n_accepted=3, draft_held=0)
    with pytest.raises(ValueError, match="n_committed"):
        crop_lengths(committed_before=1, n_drafted=2, n_accepted=1, draft_held=0, n_committed=3)

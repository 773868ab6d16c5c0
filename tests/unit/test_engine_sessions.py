"""engine.sessions.SessionCaches: the session count holds again once running calls finish."""
from __future__ import annotations

from specdec.core import fingerprint as fp
from engine.sessions import SessionCaches


class _Cache:
    """The cache interface SessionCaches uses (length, crop, free, nbytes), with no tensors."""

    nbytes = 10

    def __init__(self) -> None:
        self.freed = False

    def crop(self, length: int) -> None:
        pass

    def free(self) -> None:
        self.freed = True


def test_a_session_admitted_while_all_run_goes_back_to_the_count_once_they_finish() -> None:
    store = SessionCaches(_Cache, max_sessions=2, budget_bytes=10**9, ttl_s=60)
    running = [store.acquire(f"s{i}", 0, fp.EMPTY) for i in range(2)]
    for s in running:
        store.pin(s)
    extra = store.acquire("s2", 0, fp.EMPTY)  # every other session runs: over the count for now
    assert len(store) == 3
    store.pin(extra)
    for s in running:
        store.unpin(s)
        store.settle(s)
    store.unpin(extra)
    store.settle(extra)
    assert len(store) == 2 and "s2" in store  # the least recently used idle one went
    assert "s0" not in store and running[0].cache.freed
    assert "s1" in store and not running[1].cache.freed


def test_a_pinned_session_is_never_dropped_to_make_the_count() -> None:
    store = SessionCaches(_Cache, max_sessions=1, budget_bytes=10**9, ttl_s=60)
    a = store.acquire("a", 0, fp.EMPTY)
    store.pin(a)
    b = store.acquire("b", 0, fp.EMPTY)
    store.settle(b)  # a still runs: both stay
    assert len(store) == 2 and not a.cache.freed
    store.unpin(a)
    store.settle(a)  # now b is the idle one beside the session just served
    assert len(store) == 1 and "a" in store and b.cache.freed

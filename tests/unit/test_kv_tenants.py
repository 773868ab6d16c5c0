"""engine.sessions.SessionCaches: eviction is fair between tenants (the heaviest one's idle sessions
go first), and with one tenant it stays plain LRU."""
from __future__ import annotations

from specdec.core import fingerprint as fp
from engine.sessions import SessionCaches


class _Cache:
    """The cache interface SessionCaches uses, with a settable size and no tensors."""

    def __init__(self, nbytes: int = 10) -> None:
        self.nbytes, self.freed = nbytes, False

    def crop(self, length: int) -> None:
        pass

    def free(self) -> None:
        self.freed = True

    def copy_prefix(self, source, length: int) -> None:
        self.nbytes = source.nbytes


def _open(store: SessionCaches, sid: str, tenant: str, nbytes: int = 10):
    session = store.acquire(sid, 0, fp.EMPTY, tenant)
    session.cache.nbytes = nbytes
    store.settle(session)
    return session


def test_a_flood_of_one_tenant_evicts_its_own_sessions_under_the_count() -> None:
    store = SessionCaches(_Cache, max_sessions=8, budget_bytes=10**9, ttl_s=60)
    victims = [_open(store, f"bob{i}", "bob") for i in range(2)]  # the least recently used
    for i in range(20):
        _open(store, f"mallory{i}", "mallory")
    assert all(v.session_id in store and not v.cache.freed for v in victims)
    assert len(store) == 8
    assert [f"mallory{i}" in store for i in range(20)] == [False] * 14 + [True] * 6  # its oldest went


def test_one_tenant_is_plain_lru() -> None:
    store = SessionCaches(_Cache, max_sessions=8, budget_bytes=10**9, ttl_s=60)
    first = [_open(store, f"bob{i}", "") for i in range(2)]
    for i in range(20):
        _open(store, f"x{i}", "")
    assert not any(s.session_id in store for s in first) and all(s.cache.freed for s in first)


def test_a_flood_of_one_tenant_evicts_its_own_sessions_under_the_byte_budget() -> None:
    store = SessionCaches(_Cache, max_sessions=1000, budget_bytes=1000, ttl_s=60)
    bob = _open(store, "bob", "bob", nbytes=300)  # one large, least recently used session
    for i in range(30):
        _open(store, f"mallory{i}", "mallory", nbytes=100)
    assert "bob" in store and not bob.cache.freed
    assert store.nbytes <= 1000
    # Bob now holds the most: his idle session is what goes when he asks for more room.
    big = _open(store, "bob2", "bob", nbytes=600)
    assert "bob2" in store and "bob" not in store and big.nbytes == 600


def test_pool_pressure_takes_the_heaviest_tenants_idle_session_and_spares_running_ones() -> None:
    store = SessionCaches(_Cache, max_sessions=100, budget_bytes=10**9, ttl_s=60)
    bob = _open(store, "bob", "bob", nbytes=50)
    flood = [_open(store, f"m{i}", "mallory", nbytes=20) for i in range(5)]
    store.pin(flood[0])
    assert store.evict_idle({"m1"}, "budget")
    # Mallory's least recently used idle session went: not bob's, not a running or busy one.
    assert [s.session_id for s in flood if s.session_id not in store] == ["m2"]
    assert "bob" in store and "m0" in store and "m1" in store


def test_a_fork_belongs_to_its_tenant() -> None:
    store = SessionCaches(_Cache, max_sessions=4, budget_bytes=10**9, ttl_s=60)
    source = _open(store, "src", "bob")
    source.fingerprints = [fp.EMPTY, fp.extend(fp.EMPTY, 7)]
    assert store.fork("src", "copy", 1, source.fingerprints[1]).tenant == "bob"
    assert store.fork("src", "other", 1, source.fingerprints[1], "carol").tenant == "carol"

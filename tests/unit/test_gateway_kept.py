"""gateway.responses.kept: stored responses are their owner's, expire after their last use, and are bounded."""
from __future__ import annotations

from gateway.responses.kept import RECORD_TTL_S, ResponseStore, StoredResponse, owner


def _record(ident: str, who: str, session: str = "s") -> StoredResponse:
    return StoredResponse(id=ident, owner=who, body={"id": ident}, history=[], session_id=session)


def test_owner_only_expiry_and_capacity():
    now = [0.0]
    store = ResponseStore(ttl_s=10, capacity=2, clock=lambda: now[0])
    alice, bob = owner("Bearer a"), owner("Bearer b")
    assert alice != bob and owner(None) == ""
    store.put(_record("r1", alice))
    assert store.get("r1", bob) is None and store.delete("r1", bob) is None  # another caller's: unknown
    now[0] = 9.0
    assert store.get("r1", alice) is not None  # used: its expiry moves on
    now[0] = 18.0
    assert store.get("r1", alice) is not None and store.names_session("s")
    now[0] = 28.5
    assert store.get("r1", alice) is None and not store.names_session("s")  # expired
    for i in range(3):
        store.put(_record(f"q{i}", alice))
    assert store.get("q0", alice) is None and store.get("q2", alice) is not None  # least recently used went
    assert store.delete("q2", alice).id == "q2" and store.get("q2", alice) is None


def test_the_default_ttl_is_the_orchestrators_record_ttl():
    from specdec.runtime.store import SESSION_TTL_S

    assert RECORD_TTL_S == SESSION_TTL_S

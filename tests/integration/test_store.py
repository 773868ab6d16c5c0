"""SessionStore and ServiceRegistry against the real Redis on 127.0.0.1:6379."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from specdec.runtime.store import (
    ServiceEntry, ServiceRegistry, SessionRecord, SessionStore, StoreUnavailable, connect,
)
from specdec.runtime.procs import free_port

URL = "redis://127.0.0.1:6379/0"


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def prefix():
    p = f"specdec-test-{uuid.uuid4().hex}:"
    yield p

    async def cleanup():
        client = connect(URL)
        keys = [k async for k in client.scan_iter(match=f"{p}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()

    run(cleanup())


def test_session_round_trip_ttl_and_delete(prefix):
    async def body():
        client = connect(URL)
        store = SessionStore(client, url=URL, prefix=prefix, ttl_s=30)
        rec = SessionRecord("s1", tokens=(1, 2, 300, 70000), target="a:1", target_len=3,
                            draft="b:2", draft_len=2)
        saved = await store.save(rec)
        assert saved.created > 0 and saved.updated >= saved.created
        loaded = await store.load("s1")
        assert loaded == saved
        ttl = await client.ttl(f"{prefix}session:s1")
        assert 0 < ttl <= 30
        assert await store.load("nope") is None
        assert await store.delete("s1") is True
        assert await store.delete("s1") is False
        assert await store.load("s1") is None
        await client.aclose()

    run(body())


def test_saves_of_one_loop_turn_land_in_one_script_call_each_whole_with_its_ttl(prefix):
    """Kept and single-turn records saved together: one SAVE_SCRIPT call, every record whole, each
    its own TTL, the kept ones counted per tenant; after the script cache is flushed (a Redis
    restart) the next batch loads it again."""
    async def body():
        client = connect(URL)
        store = SessionStore(client, url=URL, prefix=prefix, ttl_s=60, single_turn_ttl_s=20)
        records = [SessionRecord(f"s{i}", tokens=tuple(range(i, i + 40)), target="a:1", target_len=39,
                                 draft="b:2" if i % 3 else "", draft_len=i, turn_start=7, turn_seed=i + 1,
                                 multi_turn=i % 2 == 0, tenant=f"t{i % 4 // 2}") for i in range(8)]
        saved = await asyncio.gather(*(store.save(r) for r in records))
        assert store.save_batches == 1
        for record in saved:
            assert await store.load(record.session_id) == record
            ttl = await client.ttl(f"{prefix}session:{record.session_id}")
            assert (40 < ttl <= 60) if record.multi_turn else (0 < ttl <= 20)
        assert await store.kept("t0") == 2 and await store.kept("t1") == 2  # s0, s2 and s4, s6
        await client.script_flush()
        again = await store.save(SessionRecord("s1", tokens=(5, 6), multi_turn=True, tenant="t0"))
        assert await store.load("s1") == again and await store.kept("t0") == 3
        await client.aclose()

    run(body())


def test_registry_lists_live_replicas_and_expires_dead_ones(prefix):
    async def body():
        client = connect(URL)
        reg = ServiceRegistry(client, url=URL, prefix=prefix, ttl_s=0.5)
        await reg.register(ServiceEntry("h:1", "target", "t1", load=2.0, tokenizer_fingerprint="f"))
        await reg.register(ServiceEntry("h:2", "target", "t2", load=1.0, tokenizer_fingerprint="f"))
        await reg.register(ServiceEntry("h:3", "draft", "d1"))
        live = await reg.live("target")
        assert [e.address for e in live] == ["h:2", "h:1"]  # lowest load first
        assert [e.address for e in await reg.live("draft")] == ["h:3"]
        await reg.deregister("target", "t2")
        assert [e.address for e in await reg.live("target")] == ["h:1"]
        await asyncio.sleep(0.7)  # no heartbeat: expired
        assert await reg.live("target") == []
        await client.aclose()

    run(body())


def test_a_burst_of_registry_reads_shares_one_and_a_later_one_reads_again(prefix):
    """New sessions that come together read the registry once (one read, one connection); a caller
    that goes away leaves the read to the others; a read after it is a new one (nothing cached)."""
    async def body():
        client = connect(URL)
        reg = ServiceRegistry(client, url=URL, prefix=prefix)
        await reg.register(ServiceEntry("h:1", "target", "t1", load=1.0))
        reads = 0
        read_live = reg._read_live

        async def counted(role):
            nonlocal reads
            reads += 1
            return await read_live(role)

        reg._read_live = counted
        callers = [asyncio.ensure_future(reg.live("target")) for _ in range(32)]
        await asyncio.sleep(0)
        callers[0].cancel()
        answers = await asyncio.gather(*callers[1:])
        assert reads == 1 and all([e.address for e in a] == ["h:1"] for a in answers)
        assert answers[1] is not answers[2]  # each caller its own list
        await reg.register(ServiceEntry("h:2", "target", "t2", load=0.5))
        assert [e.address for e in await reg.live("target")] == ["h:2", "h:1"] and reads == 2
        await client.aclose()

    run(body())


def test_unreachable_redis_fails_fast_with_store_unavailable():
    async def body():
        url = f"redis://127.0.0.1:{free_port()}/0"
        store = SessionStore(connect(url, timeout_s=0.5), url=url, prefix="x:")
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="unavailable"):
            await store.load("s")
        assert time.monotonic() - started < 3.0

    run(body())


def test_a_new_session_waits_for_a_replica_to_beat_into_an_empty_registry(prefix):
    """Redis back empty (or every target restarting): placement waits up to its bound, not fails."""
    from types import SimpleNamespace

    from orchestrator.fleet.remote import place
    from orchestrator.fleet.routing import Router

    async def body():
        client = connect(URL)
        reg = ServiceRegistry(client, url=URL, prefix=prefix)
        router = Router(reg, {}, connect=lambda address, role: SimpleNamespace(address=address))
        started = time.monotonic()
        assert await place(router, "target", "s", "", 0) is None  # no wait asked: none at once
        assert time.monotonic() - started < 1.0

        async def beat_later():
            await asyncio.sleep(0.8)
            await reg.register(ServiceEntry("h:9", "target", "t9"))

        late = asyncio.ensure_future(beat_later())
        placed = await place(router, "target", "s", "", 0, wait_s=5.0)
        await late
        assert placed is not None and placed.address == "h:9"
        assert 0.7 < time.monotonic() - started < 4.0
        started = time.monotonic()
        assert await place(router, "draft", "s", "", 0, wait_s=0.6) is None  # none ever: bounded
        assert 0.5 < time.monotonic() - started < 2.0
        await client.aclose()

    run(body())

"""Redis's memory bound (the generated redis.conf: maxmemory, volatile-lru) and the per-tenant cap
on kept sessions, against real Redis servers and a real orchestrator.

A flood of session records past maxmemory: every write still succeeds, idle records are
evicted, the registry (rewritten every heartbeat, read by every request) stays. Kept sessions
are counted per tenant in Redis (SessionStore.kept); past --max-kept-sessions-per-tenant a new
kept session is RESOURCE_EXHAUSTED naming the limit, and EndSession or the TTL makes room.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest

from client import build_request
from specdec.runtime import procs
from specdec.runtime.credentials import generate
from specdec.runtime.store import ServiceEntry, ServiceRegistry, SessionRecord, SessionStore, connect
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from tests.integration.stack import REDIS_URL, Stack
from tests.security.conftest import wait_listening


def _env_file(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.fixture(scope="module")
def small_redis(tmp_path_factory):
    """redis-server with the generated redis.conf (4 MB), plus an admin user for INFO."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    folder = tmp_path_factory.mktemp("memory")
    generate(folder / "secrets", hosts=["localhost"], redis_maxmemory="4mb")
    own = folder / "secrets" / "redis"
    port = procs.free_port()
    proc = subprocess.Popen(
        ["redis-server", str(own / "redis.conf"), "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(own / "server.crt"), "--tls-key-file", str(own / "server.key"),
         "--tls-ca-cert-file", str(own / "ca.crt"), "--save", "", "--appendonly", "no",
         "--dir", str(folder), "--user", "admin", "on", ">admin-test", "~*", "+@all"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port, proc)
    yield folder / "secrets", f"rediss://localhost:{port}/0?ssl_ca_certs={own / 'ca.crt'}"
    proc.terminate()
    proc.wait(timeout=10)


def test_the_generated_conf_bounds_memory_and_evicts_only_keys_with_a_ttl(small_redis) -> None:
    secrets, _ = small_redis
    conf = (secrets / "redis" / "redis.conf").read_text()
    assert "maxmemory 4mb\n" in conf and "maxmemory-policy volatile-lru\n" in conf
    with pytest.raises(ValueError, match="--redis-maxmemory"):
        generate(secrets.parent / "bad", redis_maxmemory="lots")


async def _flood(url: str, idle: int, fresh: int) -> tuple[list[str], bool]:
    """`idle` kept sessions of 20 kB, idle for 2 s (Redis's LRU clock ticks once a second), then
    `fresh` more with a heartbeat every 20 writes and a registry read between two: (the session
    ids, whether the replica was listed at every read). With volatile-ttl instead, the registry's
    short TTLs would make it the first to go."""
    client = connect(url)
    store = SessionStore(client, url=url, prefix="specdec:mem:", ttl_s=3600)
    registry = ServiceRegistry(client, url=url, prefix="specdec:mem:")
    entry = ServiceEntry("10.0.0.1:50061", "target", "t1", "m", "f")
    ids, listed = [], True
    try:
        for i in range(idle + fresh):
            if i == idle:
                await asyncio.sleep(2.2)
            if i % 20 == 0:
                await registry.register(entry)
            if i % 20 == 10:  # a request between two heartbeats
                listed = listed and [e.address for e in await registry.live("target")] == [entry.address]
            sid = f"s{i}"
            await store.save(SessionRecord(sid, tokens=tuple(range(5000)), multi_turn=True, tenant="t"))
            ids.append(sid)
        return ids, listed
    finally:
        await client.aclose()


async def _info(url: str) -> dict[str, str]:
    client = connect(url.replace("rediss://", "rediss://admin:admin-test@"))
    try:
        return {k: str(v) for k, v in (await client.info("all")).items()}
    finally:
        await client.aclose()


def test_a_flood_past_maxmemory_evicts_idle_records_and_keeps_the_registry(small_redis) -> None:
    secrets, url = small_redis
    env = _env_file(secrets / "orchestrator" / "orchestrator.env")
    saved = {k: os.environ.get(k) for k in ("SPECDEC_REDIS_USERNAME", "SPECDEC_REDIS_PASSWORD")}
    os.environ.update({k: env[k] for k in saved})
    try:
        ids, listed = asyncio.run(_flood(url, 120, 100))  # 4.4 MB of records into 4 MB
        assert listed  # the registry answered at every read
        info = asyncio.run(_info(url))

        async def kept(sids: list[str]) -> int:
            client = connect(url)
            try:
                return await client.exists(*[f"specdec:mem:session:{sid}" for sid in sids])
            finally:
                await client.aclose()

        assert int(info["evicted_keys"]) > 20
        assert int(info["used_memory"]) <= 4 * 2**20 * 1.1
        # The idle records went, not the ones written since (nor the registry).
        assert asyncio.run(kept(ids[:120])) <= 120 - 20 and asyncio.run(kept(ids[120:])) == 100
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


# ------------------------------------------------------------------ kept sessions per tenant


def test_kept_sessions_are_counted_per_tenant() -> None:
    prefix = f"specdec-test-{uuid.uuid4().hex[:12]}:"

    async def body() -> None:
        client = connect(REDIS_URL)
        store = SessionStore(client, url=REDIS_URL, prefix=prefix, ttl_s=60)
        try:
            for i in range(3):
                await store.save(SessionRecord(f"a{i}", tokens=(1, 2), multi_turn=True, tenant="alice"))
            await store.save(SessionRecord("b0", tokens=(1,), multi_turn=True, tenant="bob"))
            await store.save(SessionRecord("single", tokens=(1,), tenant="alice"))  # not kept
            await store.save(SessionRecord("a0", tokens=(1, 2, 3), multi_turn=True, tenant="alice"))
            assert (await store.kept("alice"), await store.kept("bob"), await store.kept("carol")) == (3, 1, 0)
            assert await store.delete("a1") and await store.kept("alice") == 2
            assert await store.delete("single") and await store.kept("alice") == 2
            # A record past its TTL is no longer counted (its score is its expiry).
            await client.zadd(f"{prefix}kept:alice", {"a2": time.time() - 1})
            assert await store.kept("alice") == 1
        finally:
            keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    asyncio.run(body())


@pytest.fixture(scope="module")
def capped(tiny_pair, tmp_path_factory):
    """Target, draft and an orchestrator with two tenants and --max-kept-sessions-per-tenant 2."""
    target_dir, draft_dir = tiny_pair
    logs = tmp_path_factory.mktemp("kept")
    (logs / "tokens").write_text("alice:alice-token-0123456789\nbob:bob-token-0123456789\n")
    s = Stack(logs=logs)
    try:
        for role, model in (("target", target_dir), ("draft", draft_dir)):
            s.start_service(role, role, model, wait=False)
        s.wait_serving("target", "draft")
        s.start_orchestrator("orch", target_dir, extra=(
            "--auth-tokens", str(logs / "tokens"), "--max-kept-sessions-per-tenant", "2",
            "--rate-per-tenant", "0"))
        with grpc.insecure_channel(s.addresses["orch"]) as channel:
            yield Capped(orchestrator_pb2_grpc.OrchestratorStub(channel), s.prefix)
    finally:
        s.stop()


@dataclass
class Capped:
    stub: orchestrator_pb2_grpc.OrchestratorStub
    prefix: str  # the stack's Redis key prefix


def _kept(capped: Capped, tenant: str) -> int:
    """The tenant's kept sessions as Redis counts them."""
    async def count() -> int:
        client = connect(REDIS_URL)
        try:
            return await SessionStore(client, url=REDIS_URL, prefix=capped.prefix, ttl_s=60).kept(tenant)
        finally:
            await client.aclose()

    return asyncio.run(count())


def _as(tenant: str):
    return (("authorization", f"Bearer {tenant}-token-0123456789"),)


def _turn(stub, tenant: str, keep: bool) -> pb.Stats:
    request = build_request("one two three", max_new_tokens=3, keep_session=keep)
    return [r.stats for r in stub.Generate(request, metadata=_as(tenant), timeout=60) if r.HasField("stats")][-1]


def test_a_tenant_past_its_kept_sessions_is_refused_and_others_are_not(capped) -> None:
    first = _turn(capped.stub, "alice", keep=True)
    second = _turn(capped.stub, "alice", keep=True)
    with pytest.raises(grpc.RpcError) as err:
        _turn(capped.stub, "alice", keep=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("max_kept_sessions_per_tenant: 2 kept sessions per tenant")
    assert _turn(capped.stub, "alice", keep=False).finish_reason  # single-turn requests still run
    assert _turn(capped.stub, "bob", keep=True).session_id  # another tenant has its own count
    # A later turn of a kept session is no new one; ending one makes room.
    request = build_request("one two three four", max_new_tokens=3, session_id=second.session_id,
                            keep_session=True)
    assert list(capped.stub.Generate(request, metadata=_as("alice"), timeout=60))
    # No way around the cap: a resume of an id nobody holds would start a kept record under it.
    forged = build_request("one two three", max_new_tokens=3, session_id="chosen-by-the-client",
                           keep_session=True)
    forged.resume_from = first.prompt_tokens  # resumed before its first token: a valid resume
    forged.delivered.append(pb.Delivered(index=0, token_ids=[]))
    with pytest.raises(grpc.RpcError) as err:
        list(capped.stub.Generate(forged, metadata=_as("alice"), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert _kept(capped, "alice") == 2
    capped.stub.EndSession(pb.EndSessionRequest(session_id=first.session_id), metadata=_as("alice"), timeout=10)
    assert _turn(capped.stub, "alice", keep=True).session_id

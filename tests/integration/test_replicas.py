"""Two target and two draft replicas discovered from Redis; two orchestrators sharing sessions."""
from __future__ import annotations

import pytest

from client import Client
from tests.integration.stack import Stack

PROMPTS = ["The cat sat on the", "A quick brown fox", "def add(a, b):", "mat is", "The capital of"]


@pytest.fixture(scope="module")
def replicas(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("replicas"))
    try:
        for i in (1, 2):
            s.start_service(f"target{i}", "target", target_dir)
            s.start_service(f"draft{i}", "draft", draft_dir)
        s.target_dir, s.draft_dir = target_dir, draft_dir
        # Affinity and failover only: on 2 shared cores a replica's wall time is noise, and a
        # learned deadline or outlier ejection would move a session for that (tests/integration/
        # test_gray.py covers those).
        quiet = ("--outlier-ratio", "0", "--deadline-factor", "0")
        s.start_orchestrator("orchA", target_dir, extra=quiet)
        s.start_orchestrator("orchB", target_dir, extra=quiet)
        yield s
    finally:
        s.stop()


def test_sessions_spread_over_replicas_and_stick_to_their_kv(replicas):
    targets = {replicas.addresses["target1"], replicas.addresses["target2"]}
    drafts = {replicas.addresses["draft1"], replicas.addresses["draft2"]}
    with Client(replicas.addresses["orchA"]) as a, Client(replicas.addresses["orchB"]) as b:
        runs = []
        for prompt in PROMPTS * 2:
            out = a.complete(prompt, max_new_tokens=12, proposer="draft", k=3, keep_session=True)
            ref = a.complete(prompt, max_new_tokens=12, proposer="none")
            assert out.token_ids == ref.token_ids
            runs.append(out)
        assert {r.stats.target_replica for r in runs} == targets
        assert {r.stats.draft_replica for r in runs} == drafts

        # Continue every session through the OTHER orchestrator: it finds the
        # record in Redis and routes to the replicas holding the KV.
        for prompt, first in zip(PROMPTS, runs):
            follow = prompt + " and then"
            cont = b.complete(follow, max_new_tokens=8, proposer="draft", k=3,
                              session_id=first.stats.session_id)
            assert cont.stats.target_replica == first.stats.target_replica
            assert cont.stats.draft_replica == first.stats.draft_replica
            assert cont.stats.reused_prompt_tokens > 0
            assert cont.stats.cache_misses == 0
            fresh = b.complete(follow, max_new_tokens=8, proposer="none")
            assert cont.token_ids == fresh.token_ids


def test_a_dead_replica_drops_out_and_its_sessions_move(replicas, tiny_pair):
    with Client(replicas.addresses["orchA"]) as a:
        first = a.complete(PROMPTS[0], max_new_tokens=8, proposer="draft", k=3, keep_session=True)
        holder = next(n for n in ("target1", "target2")
                      if replicas.addresses[n] == first.stats.target_replica)
        replicas.stop_one(holder)  # deregisters on SIGTERM
        cont = a.complete(PROMPTS[0] + " and", max_new_tokens=8, proposer="draft", k=3,
                          session_id=first.stats.session_id)
        assert cont.stats.target_replica != first.stats.target_replica
        assert cont.stats.reused_prompt_tokens == 0  # the new replica had nothing cached
        fresh = a.complete(PROMPTS[0] + " and", max_new_tokens=8, proposer="none")
        assert cont.token_ids == fresh.token_ids


def test_killing_the_target_mid_stream_fails_over_with_identical_text(replicas):
    import asyncio
    import os
    import signal

    from specdec.runtime.store import SessionStore, connect

    async def holder(session_id: str) -> str:
        redis = connect(replicas.redis_url)
        try:
            record = await SessionStore(redis, prefix=replicas.prefix).load(session_id)
            return record.target if record else ""
        finally:
            await redis.aclose()

    live = [n for n in ("target1", "target2") if n in replicas.procs]
    if len(live) < 2:
        replicas.start_service("target2" if "target1" in live else "target1", "target",
                               replicas.target_dir)
    with Client(replicas.addresses["orchA"]) as a:
        first = a.complete(PROMPTS[1], max_new_tokens=4, proposer="none", keep_session=True)
        expected = a.complete(PROMPTS[1] + " x", max_new_tokens=120, proposer="none")
        stream = a.generate(PROMPTS[1] + " x", max_new_tokens=120, proposer="draft", k=2,
                            session_id=first.stats.session_id)
        chunks, killed = [], ""
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                address = asyncio.run(holder(first.stats.session_id))
                name = next(n for n, addr in replicas.addresses.items()
                            if addr == address and n in replicas.procs)
                os.kill(replicas.procs[name].pid, signal.SIGKILL)  # no goodbye, no deregistration
                killed = address
        assert killed
        assert tuple(t for c in chunks for t in c.token_ids) == expected.token_ids
        assert stream.stats.target_replica != killed


def test_killing_the_draft_mid_stream_moves_to_the_other_draft(replicas):
    import os
    import signal

    for name in ("draft1", "draft2"):
        if name not in replicas.procs:
            replicas.start_service(name, "draft", replicas.draft_dir)
    with Client(replicas.addresses["orchA"]) as a:
        expected = a.complete(PROMPTS[2], max_new_tokens=100, proposer="none")
        stream = a.generate(PROMPTS[2], max_new_tokens=100, proposer="draft", k=2)
        chunks, killed = [], ""
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                # Both drafts may serve it; kill the one the session started on.
                killed = _session_draft(replicas)
                name = next(n for n, addr in replicas.addresses.items()
                            if addr == killed and n in replicas.procs)
                os.kill(replicas.procs[name].pid, signal.SIGKILL)
        assert tuple(t for c in chunks for t in c.token_ids) == expected.token_ids
        assert stream.stats.draft_replica != killed
        assert stream.stats.proposer == "draft" and not stream.stats.fallback_reason
        assert stream.stats.draft_calls > 5


def _session_draft(replicas) -> str:
    """The draft replica of the newest session in this test's Redis namespace."""
    import asyncio

    from specdec.runtime.store import SessionStore, connect

    async def newest() -> str:
        redis = connect(replicas.redis_url)
        try:
            store = SessionStore(redis, prefix=replicas.prefix)
            keys = [k.decode() async for k in redis.scan_iter(match=f"{replicas.prefix}session:*")]
            records = [await store.load(k.rsplit(":", 1)[1]) for k in keys]
            return max((r for r in records if r), key=lambda r: r.created).draft
        finally:
            await redis.aclose()

    return asyncio.run(newest())

"""The service registry is validated, not trusted: a real orchestrator, real Redis, planted entries.

The only usable target entry carries an unknown field: it is used (the field ignored, one log
line). Entries that would be preferred (lower load) but have no tokenizer fingerprint, another
fingerprint, another model, another role, no address, no JSON at all, an oversized value, or a
heartbeat long past (or far in the future: a value written to live for ever) point at a socket
that counts connections: requests keep succeeding, nothing ever dials it, and each entry is
logged once as ignored.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import redis

from client import Client
from specdec.v1 import common_pb2, model_pb2_grpc
from tests.integration.stack import REDIS_URL, Stack


class CountingListener:
    """A TCP port that accepts and counts connections (and answers nothing)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _plant(r: redis.Redis, prefix: str, role: str, replica_id: str, value: str) -> None:
    """An entry written straight into Redis, as a compromised or outdated replica could."""
    r.set(f"{prefix}service:{role}:{replica_id}", value)
    r.zadd(f"{prefix}services:{role}", {replica_id: time.time() + 3600})


@pytest.fixture(scope="module")
def registry_stack(tiny_pair, tmp_path_factory):
    target_dir, _ = tiny_pair
    stack = Stack(logs=tmp_path_factory.mktemp("registry"))
    r = redis.Redis.from_url(REDIS_URL)
    bogus = CountingListener()
    beating = threading.Event()
    try:
        address = stack.start_service("target", "target", target_dir, register=False)
        import grpc

        with grpc.insecure_channel(address) as channel:
            info = model_pb2_grpc.TargetServiceStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        real = {"address": address, "role": "target", "replica_id": "real", "model_name": info.model_name,
                "tokenizer_fingerprint": info.tokenizer_fingerprint, "load": 0.0, "seen": time.time()}
        # The one usable target: from a newer replica that sends a field this version lacks,
        # beating as a replica does (its heartbeat time kept fresh).
        def beat() -> None:
            while not beating.is_set():
                _plant(r, stack.prefix, "target", "real", json.dumps({**real, "zone": "eu-west",
                                                                      "seen": time.time()}))
                beating.wait(1.0)

        _plant(r, stack.prefix, "target", "real", json.dumps({**real, "zone": "eu-west"}))
        threading.Thread(target=beat, daemon=True).start()
        stack.start_orchestrator("orch", target_dir)  # discovers the target in the registry alone
        lure = {**real, "address": bogus.address, "load": -10.0}  # preferred, were it trusted
        planted = {
            "no-fingerprint": {**lure, "replica_id": "no-fingerprint", "tokenizer_fingerprint": ""},
            "other-fingerprint": {**lure, "replica_id": "other-fingerprint",
                                  "tokenizer_fingerprint": "f" * 64},
            "other-model": {**lure, "replica_id": "other-model", "model_name": "someone-elses-model"},
            "draft-as-target": {**lure, "replica_id": "draft-as-target", "role": "draft"},
            "no-address": {**lure, "replica_id": "no-address", "address": ""},
            "wrong-type": {**lure, "replica_id": "wrong-type", "load": "low"},
            "stale": {**lure, "replica_id": "stale", "seen": time.time() - 3600},
            "for-ever": {**lure, "replica_id": "for-ever", "seen": time.time() + 10 ** 6},
            "oversized": {**lure, "replica_id": "oversized", "zone": "x" * 8192},
        }
        for replica_id, entry in planted.items():
            _plant(r, stack.prefix, "target", replica_id, json.dumps(entry))
        _plant(r, stack.prefix, "target", "not-json", "{this is not json")
        yield stack, bogus, [*planted, "not-json"]
    finally:
        beating.set()
        bogus.close()
        stack.stop()  # deletes every key under the stack's own prefix
        r.close()


def test_requests_keep_succeeding_and_bad_entries_are_ignored_with_a_log_line(registry_stack) -> None:
    stack, bogus, ignored = registry_stack
    with Client(stack.addresses["orch"], timeout=60) as c:
        for i in range(6):
            done = c.complete(f"the registry test {i}", max_new_tokens=4, proposer="none")
            assert done.stats.new_tokens == 4
    assert bogus.connections == 0  # no planted replica was ever dialled
    log = (stack.logs / "orch.log").read_text()
    assert "service registry entry" in log and "fields zone ignored" in log
    lines = [line for line in log.splitlines() if "service registry entry" in line and "ignored:" in line]
    for replica_id in ignored:
        mine = [line for line in lines if f"service:target:{replica_id}:" in line]
        assert len(mine) == 1, (replica_id, mine)  # logged once, not once per request
    assert "it has no tokenizer fingerprint" in log and "its tokenizer fingerprint ffff" in log
    assert "serves 'someone-elses-model'" in log and "it names role 'draft'" in log
    assert "its last heartbeat is 3" in log and "s in the future" in log and "bytes, above 4096" in log

"""--redis-url: a service announces itself in the registry while it serves."""
from __future__ import annotations

import asyncio
import time
import uuid

from specdec.runtime import store


def _live(prefix: str, role: str) -> list[store.ServiceEntry]:
    async def go() -> list[store.ServiceEntry]:
        client = store.connect(store.DEFAULT_URL)
        try:
            return await store.ServiceRegistry(client, prefix=prefix).live(role)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _cleanup(prefix: str) -> None:
    async def go() -> None:
        client = store.connect(store.DEFAULT_URL)
        try:
            keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()

    asyncio.run(go())


def test_service_registers_while_serving_and_leaves_on_shutdown(services, tiny_pair) -> None:
    prefix = f"specdec-test-{uuid.uuid4().hex[:8]}:"
    try:
        svc = services("draft", tiny_pair[1], "--redis-url", store.DEFAULT_URL,
                       "--redis-prefix", prefix)
        deadline = time.monotonic() + 10
        while not (entries := _live(prefix, "draft")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(entries) == 1
        entry = entries[0]
        assert entry.address == svc.address
        assert entry.replica_id.endswith(f":{svc.port}")
        assert entry.model_name == "draft" and len(entry.tokenizer_fingerprint) == 64
        assert svc.stop() == 0
        assert _live(prefix, "draft") == []  # deregistered on SIGTERM, not left to expire
    finally:
        _cleanup(prefix)

"""Background jobs a model server runs while SERVING (server.OnServing hooks)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import logging
from collections.abc import Awaitable, Callable

from engine.host import ModelHost
from specdec.runtime.server import OnServing, ServerOptions

log = logging.getLogger(__name__)


def _canceller(task: asyncio.Task) -> Callable[[], Awaitable[None]]:
    """The shutdown callback of an on_serving hook's background task."""

    async def cleanup() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return cleanup


def registration(host: ModelHost, options: ServerOptions, role: str) -> OnServing:
    """Announce this replica in Redis with a heartbeat (--redis-url)."""

    async def on_serving(address: str) -> Callable[[], Awaitable[None]]:
        from specdec.runtime import store  # imports redis: only when registration is asked for

        registry = store.ServiceRegistry(
            store.connect(options.redis_url), url=options.redis_url, prefix=options.redis_prefix
        )
        entry = store.ServiceEntry(
            address=options.public_address,
            role=role,
            replica_id=host.replica_id,
            model_name=host.loaded.name,
            tokenizer_fingerprint=host.loaded.tokenizer_fingerprint,
        )
        task = asyncio.create_task(
            store.heartbeat(registry, entry, load=lambda: float(len(host.caches)))
        )
        log.info("registering as %s %s at %s in %s", role, host.replica_id, entry.address,
                 options.redis_url)
        return _canceller(task)

    return on_serving


def sweeper(host: ModelHost) -> OnServing:
    """Free sessions idle beyond --kv-idle-ttl."""

    async def on_serving(address: str) -> Callable[[], Awaitable[None]]:
        period = max(0.5, min(host.limits.session_ttl_s / 4, 30.0))

        async def loop() -> None:
            while True:
                await asyncio.sleep(period)
                expired = (await host.run(host.expire)).value
                if expired:
                    log.info("freed %d idle session(s)", expired)

        return _canceller(asyncio.create_task(loop()))

    return on_serving


def chain(*hooks: OnServing) -> OnServing:
    """One hook running `hooks` in order; their cleanups run in reverse."""

    async def on_serving(address: str):
        cleanups = [await hook(address) for hook in hooks]

        async def cleanup() -> None:
            for c in reversed(cleanups):
                if c is not None:
                    await c()

        return cleanup

    return on_serving


def exit_on_fatal(reason: str) -> None:
    """The host's on_fatal: stop serving the way SIGTERM does (NOT_SERVING at once,
    deregistration, drain up to --grace), so the orchestrator moves the sessions;
    serve.main then exits non-zero. Called from the worker or watchdog thread."""
    log.critical("model worker unusable (%s): turning NOT_SERVING and exiting", reason)
    os.kill(os.getpid(), signal.SIGTERM)

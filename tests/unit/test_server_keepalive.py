"""A client that stops answering (frozen, or its host gone) loses its calls: the servers' keepalive
(specdec.runtime.server.ServerOptions.grpc_options) pings idle connections and drops one whose
peer does not answer, which cancels its calls, so what they held is freed. Without keepalive the
call is held on (the control)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from specdec.runtime.server import ServerOptions

CLIENT = """
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
next(call)
print("ready", flush=True)
sys.stdin.read()  # until the test ends it
"""


class _Held(HealthServicer):
    """Watch answers once, then holds the call until it is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def Watch(self, request, context):  # noqa: N802
        await context.write(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def _frozen_client_cancelled_within(options: ServerOptions, wait_s: float) -> float | None:
    """Seconds from freezing the client to its call's cancellation, None if not within `wait_s`."""
    held = _Held()
    server = grpc.aio.server(options=options.grpc_options())
    health_pb2_grpc.add_HealthServicer_to_server(held, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.get_running_loop().run_in_executor(None, client.stdout.readline)
        assert line.strip() == "ready", line
        os.kill(client.pid, signal.SIGSTOP)  # the process stays, its connection open, silent
        frozen = time.monotonic()
        try:
            await asyncio.wait_for(held.cancelled.wait(), wait_s)
            return time.monotonic() - frozen
        except asyncio.TimeoutError:
            return None
    finally:
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
        await server.stop(0)


def test_a_frozen_client_loses_its_call_to_keepalive() -> None:
    fast = ServerOptions(keepalive_s=1.0, keepalive_timeout_s=1.0)
    seconds = asyncio.run(_frozen_client_cancelled_within(fast, 20.0))
    assert seconds is not None, "the frozen client's call was never cancelled"
    off = ServerOptions(keepalive_s=0.0)
    assert asyncio.run(_frozen_client_cancelled_within(off, 5.0)) is None  # the control: held on


def test_the_options_carry_keepalive_and_connection_age() -> None:
    options = dict(ServerOptions(keepalive_s=30, keepalive_timeout_s=10, max_connection_age_s=600,
                                 max_connection_age_grace_s=60).grpc_options())
    assert options["grpc.keepalive_time_ms"] == 30_000 and options["grpc.keepalive_timeout_ms"] == 10_000
    assert options["grpc.max_connection_age_ms"] == 600_000
    assert options["grpc.max_connection_age_grace_ms"] == 60_000
    defaults = dict(ServerOptions().grpc_options())
    assert defaults["grpc.keepalive_time_ms"] == 60_000 and "grpc.max_connection_age_ms" not in defaults

"""The floor a message between two processes costs: a gRPC stream against a bare socket.

    python -m benchmarks.micro.transport_floor [--messages 2000] [--bytes 2000] [--event-loop uvloop]

A round of specdec crosses process boundaries as messages: the orchestrator's
Score batch to the target and its answer (one message each way on the
ScoreStream), the chunk to the caller. At millisecond forwards what one such
exchange costs, in latency and in CPU on each side, sets a round's fixed cost.
This measures it alone, with nothing else in the processes: a server process
echoes each message back, over

  grpc stream   one bidirectional grpc.aio stream (bytes in, bytes out), as the
                batch streams of orchestrator.fleet.streams use;
  grpc unary    one grpc.aio unary call per exchange;
  socket        a length-prefixed frame on one asyncio TCP connection.

Each is run `--messages` times after a warm-up; it prints the median round trip
and both processes' CPU time per exchange (the client's from its own clock, the
server's from /proc), best of `--repeats`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import grpc

from specdec.runtime import loop as event_loop

_SERVICE = "specdec.bench.Echo"
_HEADER = struct.Struct("<I")


def _same(b: bytes) -> bytes:
    return b


async def _serve(grpc_port: int, socket_port: int) -> None:
    server = grpc.aio.server()

    async def stream(requests, context):
        async for message in requests:
            yield message

    async def unary(message, context):
        return message

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {
        "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same)}),))
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(_HEADER.size)
                writer.write(header + await reader.readexactly(_HEADER.unpack(header)[0]))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    await asyncio.start_server(echo, "127.0.0.1", socket_port)
    print("ready", flush=True)
    await server.wait_for_termination()


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds (user + system) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(kind: str, grpc_port: int, socket_port: int, server_pid: int, messages: int,
                   payload: bytes) -> tuple[float, float, float]:
    """(median round trip, client CPU per exchange, server CPU per exchange), in seconds."""
    if kind == "socket":
        reader, writer = await asyncio.open_connection("127.0.0.1", socket_port)
        frame = _HEADER.pack(len(payload)) + payload

        async def exchange() -> None:
            writer.write(frame)
            await reader.readexactly(_HEADER.unpack(await reader.readexactly(_HEADER.size))[0])
        close = writer.close
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        if kind == "grpc stream":
            call = channel.stream_stream(f"/{_SERVICE}/Stream", _same, _same)()

            async def exchange() -> None:
                await call.write(payload)
                await call.read()

            def close() -> None:
                call.cancel()
        else:
            unary = channel.unary_unary(f"/{_SERVICE}/Unary", _same, _same)

            async def exchange() -> None:
                await unary(payload)
            close = lambda: None  # noqa: E731
    for _ in range(max(10, messages // 10)):
        await exchange()
    times = []
    cpu, server = time.process_time(), _cpu_s(server_pid)
    for _ in range(messages):
        start = time.perf_counter()
        await exchange()
        times.append(time.perf_counter() - start)
    client_s, server_s = time.process_time() - cpu, _cpu_s(server_pid) - server
    close()
    if kind != "socket":
        await channel.close()
    return statistics.median(times), client_s / messages, server_s / messages


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run(args: argparse.Namespace, server_pid: int, grpc_port: int, socket_port: int) -> list[str]:
    payload = os.urandom(args.bytes)
    lines = [f"{args.bytes}-byte messages, {args.messages} exchanges, best of {args.repeats}, "
             f"event loop {args.event_loop}:",
             f"{'transport':<12} {'round trip':>11} {'client CPU':>11} {'server CPU':>11}"]
    for kind in ("grpc stream", "grpc unary", "socket"):
        runs = [await _measure(kind, grpc_port, socket_port, server_pid, args.messages, payload)
                for _ in range(args.repeats)]
        rtt, client, server = (min(r[i] for r in runs) for i in range(3))
        lines.append(f"{kind:<12} {rtt * 1e6:>8.0f} µs {client * 1e6:>8.0f} µs {server * 1e6:>8.0f} µs")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000, help="exchanges timed per transport")
    parser.add_argument("--bytes", type=int, default=2000, help="message size (a 64-row Score batch: ~2 kB)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per transport; the best is reported")
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="both processes' event loop (specdec.runtime.loop)")
    parser.add_argument("--serve", nargs=2, type=int, metavar=("GRPC_PORT", "SOCKET_PORT"),
                        help=argparse.SUPPRESS)  # the echo server process
    args = parser.parse_args(argv)
    if args.serve:
        event_loop.run(_serve(*args.serve), args.event_loop)
        return []
    grpc_port, socket_port = _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.micro.transport_floor", "--event-loop",
                               args.event_loop, "--serve", str(grpc_port), str(socket_port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the echo server did not start")
        lines = event_loop.run(_run(args, server.pid, grpc_port, socket_port), args.event_loop)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()

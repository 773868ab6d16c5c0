"""What the gateway checks before any route runs: the body's size, who may call, from where.

    BodyLimit     a body over --max-body-bytes is a 413 while it is read: a Content-Length above
                  the limit is refused before one byte of the body; a chunked body is counted as
                  it arrives and refused at the first byte over (never buffered whole).
    HostCheck     when the orchestrator takes calls without a token, only the --allowed-hosts
                  names (localhost by default) may be in Host, and in Origin when a browser sends
                  one: a web page on another origin, or one that rebinds its DNS name to
                  127.0.0.1, cannot drive a local token-less gateway (403).
    Credentials   whether the orchestrator requires a token: one EndSession with no credentials
                  and no session id (UNAUTHENTICATED: required; INVALID_ARGUMENT: not), re-asked
                  now and then; unknown (unreachable) counts as not required.
    client_address  the caller's address for per-visitor quotas: X-Forwarded-For is believed
                  only from --trusted-proxies, right to left up to the first untrusted hop.

Each is a pure ASGI layer or a small object, so nothing here reads a body it will not keep.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import grpc

log = logging.getLogger("gateway")

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_UNGUARDED = {("GET", "/health"), ("GET", "/v1/models")}  # the probes' routes: nothing private


class BodyTooLarge(Exception):
    """Raised inside `receive` when the body passes the limit (BodyLimit answers 413)."""


async def _refuse(send, status: int, message: str, code: str) -> None:
    """An OpenAI error body, sent straight on the ASGI channel."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class BodyLimit:
    """A 413 for a body over `limit` bytes, decided before reading it or as it is read."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.limit):
            return await self._too_large(send)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge
            return message

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if not started:  # else the route answered without the whole body: nothing to add
                await self._too_large(send)

    async def _too_large(self, send) -> None:
        await _refuse(send, 413, f"the request body is larger than this gateway's limit of "
                      f"{self.limit} bytes (--max-body-bytes)", "request_too_large")


class Credentials:
    """Whether the orchestrator requires a token, asked with a call that does no work."""

    KNOWN_S = 30.0  # how long an answer is kept
    UNKNOWN_S = 2.0  # how soon an unreachable orchestrator is asked again

    def __init__(self) -> None:
        self.required: bool | None = None
        self._asked = float("-inf")

    async def check(self, channel: grpc.aio.Channel) -> bool | None:
        """True / False, or None while the orchestrator does not answer."""
        keep = self.UNKNOWN_S if self.required is None else self.KNOWN_S
        if time.monotonic() - self._asked < keep:
            return self.required
        self._asked = time.monotonic()
        from specdec.v1 import orchestrator_pb2 as pb
        from specdec.v1 import orchestrator_pb2_grpc

        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        try:
            await stub.EndSession(pb.EndSessionRequest(session_id=""), timeout=2.0)
            self.required = False
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.required = None
            else:
                self.required = code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        return self.required


def parse_hosts(text: str) -> frozenset[str] | None:
    """--allowed-hosts as lower-case names (IPv6 without brackets); None for '*' (any)."""
    names = {h.strip().lower().strip("[]") for h in text.split(",") if h.strip()}
    return None if "*" in names else frozenset(names)


def _host_of_header(value: str) -> str:
    """The name in a Host header: 'localhost:8000' -> 'localhost', '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HostCheck:
    """403 unless Host (and Origin, if sent) name an allowed host, while no token is required."""

    def __init__(self, app, allowed: frozenset[str] | None, credentials: Credentials, channel) -> None:
        self.app, self.allowed, self.credentials, self.channel = app, allowed, credentials, channel

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or self.allowed is None
                or (scope["method"], scope["path"]) in _UNGUARDED):
            return await self.app(scope, receive, send)
        problem = self.problem(_header(scope, b"host") or "", _header(scope, b"origin"))
        if problem and not await self.credentials.check(self.channel()):
            return await _refuse(send, 403, problem + "; callers need no token here, so only "
                                 "these names may reach it (--allowed-hosts)", "forbidden_host")
        await self.app(scope, receive, send)

    def problem(self, host: str, origin: str | None) -> str:
        """Why this Host / Origin is not allowed ("" when it is)."""
        if _host_of_header(host) not in self.allowed:
            return f"Host {host!r} is not one of {', '.join(sorted(self.allowed))}"
        if origin is None:
            return ""  # not a browser's cross-origin request
        try:
            name = (urlsplit(origin).hostname or "") if origin != "null" else ""
        except ValueError:
            name = ""
        if name not in self.allowed:
            return f"Origin {origin!r} is not one of {', '.join(sorted(self.allowed))}"
        return ""


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(text: str) -> tuple[Network, ...]:
    """--trusted-proxies: addresses or CIDR blocks, comma-separated."""
    try:
        return tuple(ipaddress.ip_network(p.strip(), strict=False) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise SystemExit(f"--trusted-proxies: {exc}") from None


def _within(address: str, networks: Iterable[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return False
    return any(ip in net for net in networks)


def client_address(peer: str | None, forwarded_for: str | None, trusted: tuple[Network, ...]) -> str:
    """The caller's address: the peer's, unless the peer is a trusted proxy; then the right-most
    X-Forwarded-For hop that is not a trusted proxy (what the nearest untrusted party claimed
    can be forged; nothing before it is believed)."""
    address = peer or "unknown"
    if not forwarded_for or not _within(address, trusted):
        return address
    for hop in reversed([h.strip() for h in forwarded_for.split(",") if h.strip()]):
        address = hop
        if not _within(hop, trusted):
            break
    return address

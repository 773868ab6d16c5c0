"""What the gateway checks before any route runs: the body's size, who may call, from where.

    TokenCheck    while the orchestrator requires tokens: a request with no bearer token is a 401,
                  one whose token the orchestrator refuses a 403, both from the headers alone,
                  before one byte of the body is read (only the probes and the playground's
                  page go without); each token's verdict is asked of the orchestrator once and
                  kept a while, by its digest.
    header_timeout_protocol  uvicorn's HTTP/1.1 protocol with a deadline on a request's headers:
                  a connection whose request line and headers do not all arrive within
                  --header-timeout seconds is closed (uvicorn keeps a slow sender's
                  connection for ever, and it counts against --max-concurrency).
    BodyLimit     a body over --max-body-bytes is a 413 while it is read: a Content-Length above
                  the limit is refused before one byte of the body; a chunked body is counted as
                  it arrives and refused at the first byte over (never buffered whole); a body
                  that stalls for --body-timeout seconds is a 408.
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

import asyncio
import hashlib
import ipaddress
import json
import logging
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import grpc

from specdec.runtime.security import KeptAnswers

log = logging.getLogger("gateway")

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_UNGUARDED = {("GET", "/health"), ("GET", "/health/live"), ("GET", "/v1/models")}  # no Host check


def open_to_anyone(method: str, path: str) -> bool:
    """What needs no token even when tokens are required: the probes (readiness and liveness,
    which say nothing private) and the playground's page, its files and its read-only views
    (the page asks for a token before it generates)."""
    return method == "GET" and (path in ("/health", "/health/live") or path == "/playground"
                                or path.startswith("/playground/static/")
                                or path in ("/playground/", "/playground/api/info",
                                            "/playground/api/speedup"))


class BodyTooLarge(Exception):
    """Raised inside `receive` when the body passes the limit (BodyLimit answers 413)."""


class BodyStalled(Exception):
    """Raised inside `receive` when the body's next part takes too long (BodyLimit answers 408)."""


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error"}


async def _refuse(send, status: int, message: str, code: str) -> None:
    """An OpenAI error body, sent straight on the ASGI channel."""
    body = json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol class, closing a connection whose next request's headers take
    longer than `seconds` from their first byte (or from the connection's start)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if self._header_timer is None and (before is None or before.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not before:  # its headers are all in: the request runs
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.info("closed a connection from %s: its request headers took over %g s",
                         self.client, seconds)
                self.transport.close()

    return HeaderTimeout


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class BodyLimit:
    """A 413 for a body over `limit` bytes, decided before reading it or as it is read; a 408 for
    a body whose next part does not come within `timeout_s`."""

    def __init__(self, app, limit: int, timeout_s: float = 30.0) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.limit):
            return await self._too_large(send)
        received = 0
        started = whole = False

        async def counted_receive():
            nonlocal received, whole
            if whole:  # after the body: waits for the client to go (a stream's watch), untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise BodyStalled from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge
                whole = not message.get("more_body", False)
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
        except BodyStalled:
            if not started:
                await _refuse(send, 408, f"the request body stalled: no part of it came for "
                              f"{self.timeout_s:g} s (--body-timeout)", "request_timeout")

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


class TokenVerdicts:
    """What the orchestrator says of each bearer token: accepted (None), or the HTTP status that
    refuses it (401 / 403). Asked with a call that does no work and kept for KEEP_S per token
    digest, at most MAX_KEPT of them (least recently used go first); callers of one token at
    once share one question."""

    KEEP_S = 30.0
    MAX_KEPT = 4096

    def __init__(self) -> None:
        self._answers = KeptAnswers(self.MAX_KEPT)

    async def status(self, channel: grpc.aio.Channel, authorization: str) -> int | None:
        key = hashlib.sha256(authorization.encode("latin-1", "replace")).hexdigest()
        # An unreachable orchestrator's answer (503) is asked again next time.
        return await self._answers.get(key, lambda: self._ask(channel, authorization),
                                       lambda verdict: 0.0 if verdict == 503 else self.KEEP_S)

    @staticmethod
    async def _ask(channel: grpc.aio.Channel, authorization: str) -> int | None:
        from specdec.v1 import orchestrator_pb2 as pb
        from specdec.v1 import orchestrator_pb2_grpc

        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        try:
            await stub.EndSession(pb.EndSessionRequest(session_id=""), timeout=2.0,
                                  metadata=(("authorization", authorization),))
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return 401
            if code == grpc.StatusCode.PERMISSION_DENIED:
                return 403
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return 503
        return None  # past the token check (an empty session id is then INVALID_ARGUMENT)


class TokenCheck:
    """While the orchestrator requires tokens, a request's token is checked from its headers,
    before its body is read: none (or not a bearer token) is a 401, one the orchestrator
    refuses a 403, an orchestrator that does not answer a 503. Then the route runs, and the
    orchestrator checks the token again on the real call."""

    def __init__(self, app, credentials: Credentials, verdicts: TokenVerdicts, channel) -> None:
        self.app, self.credentials, self.verdicts, self.channel = app, credentials, verdicts, channel

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or open_to_anyone(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)
        if not await self.credentials.check(self.channel()):
            return await self.app(scope, receive, send)  # no token needed (or not known yet)
        authorization = _header(scope, b"authorization") or ""
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return await _refuse(send, 401, "missing credentials: send 'authorization: Bearer <token>'",
                                 "missing_credentials")
        verdict = await self.verdicts.status(self.channel(), authorization)
        if verdict == 503:
            return await _refuse(send, 503, "the orchestrator does not answer, so the token cannot be "
                                 "checked; try again", "orchestrator_unavailable")
        if verdict is not None:
            log.info("refused a request to %s %s: its token was %s", scope["method"], scope["path"],
                     "missing" if verdict == 401 else "not accepted")
            return await _refuse(send, verdict, "the token is not accepted" if verdict == 403
                                 else "missing credentials: send 'authorization: Bearer <token>'",
                                 "invalid_api_key")
        await self.app(scope, receive, send)


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

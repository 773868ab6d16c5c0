"""Transport security and authentication for every specdec hop.

    TLS       grpc's own credentials: a server presents --tls-cert/--tls-key and,
              with --tls-client-ca, requires client certificates (mutual TLS).
              Clients trust --tls-ca (or --service-tls-ca for the orchestrator's
              calls to the model services) and may present a certificate.
    Tokens    `authorization: Bearer <token>` gRPC metadata. The orchestrator
              maps each token to a tenant (--auth-tokens FILE: `tenant:token`
              lines, or a JSON object {tenant: token | [tokens]}); the model
              services accept the orchestrators' service token, given as the
              token itself (--service-token) or, so that a model pod holds no
              orchestrator credential, as its SHA-256 (--service-token-sha256,
              several during a rotation).
    Identity  a model service that requires client certificates accepts only
              the certificate naming --tls-client-id (the orchestrators':
              spiffe://specdec/orchestrator, what `specdec secrets` issues);
              any other certificate its CA signed is PERMISSION_DENIED.
    Open      grpc.health.v1 and server reflection need no token; every other
              method does, whatever its shape (specdec.runtime.errors fails closed).

`BearerGuard` is the check the server bootstrap runs before every handler
(through `specdec.runtime.errors.ErrorInterceptor`); it puts the caller's tenant in
`TENANT` for the handler. Token comparison is by SHA-256 digest lookup, so the
time taken does not depend on how much of a guess matches.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import grpc

from specdec.runtime.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ANONYMOUS = ""  # the tenant of every caller when no tokens are configured

# The authenticated tenant of the call being handled (set by BearerGuard).
TENANT: ContextVar[str] = ContextVar("specdec_tenant", default=ANONYMOUS)


def read_file(path: str | os.PathLike | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def redact_url(url: str) -> str:
    """`url` without its password (for logs): redis://:***@host:6379/0."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# ------------------------------------------------------------------ credentials


def server_credentials(cert: str | None, key: str | None,
                       client_ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS server credentials, requiring client certificates when `client_ca` is set; None = plaintext."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials(
        [(read_file(key), read_file(cert))],
        root_certificates=read_file(client_ca),
        require_client_auth=bool(client_ca),
    )


def channel_credentials(ca: str | None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials trusting `ca` (presenting cert/key for mutual TLS); None = plaintext."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both its cert and key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca), private_key=read_file(key), certificate_chain=read_file(cert)
    )


def aio_channel(address: str, credentials: grpc.ChannelCredentials | None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=list(options))


def sync_channel(address: str, credentials: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=list(options))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# ------------------------------------------------------------------ tokens


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token: what a server that must not hold the token is given."""
    return _digest(token).hex()


_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def parse_digests(text: str) -> list[str]:
    """Hex SHA-256 digests from a comma- or space-separated list (lower-cased)."""
    digests = [d.strip().lower() for d in re.split(r"[,\s]+", text) if d.strip()]
    bad = [d for d in digests if not _SHA256_RE.match(d)]
    if bad:
        raise ValueError(f"--service-token-sha256: {len(bad)} value(s) are not 64 hex digits")
    return digests


_TENANT_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


def parse_tokens(text: str) -> dict[str, str]:
    """{token: tenant} from `tenant:token` lines (# comments) or a JSON object {tenant: token(s)}."""
    pairs: list[tuple[str, str]] = []
    stripped = text.strip()
    if stripped.startswith("{"):
        for tenant, tokens in json.loads(stripped).items():
            for token in [tokens] if isinstance(tokens, str) else tokens:
                pairs.append((tenant, token))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, token = line.partition(":")
            if not sep:
                raise ValueError(f"token file line {n}: expected tenant:token")
            pairs.append((tenant.strip(), token.strip()))
    table: dict[str, str] = {}
    for tenant, token in pairs:
        if not _TENANT_RE.match(tenant):
            raise ValueError(f"tenant name {tenant!r}: 1-64 of letters, digits, _ . @ -")
        if len(token) < 16:
            raise ValueError(f"the token of tenant {tenant!r} is shorter than 16 characters")
        if token in table and table[token] != tenant:
            raise ValueError("one token names two tenants")
        table[token] = tenant
    if not table:
        raise ValueError("the token file names no tokens")
    return table


class TokenTable:
    """Tokens -> tenants, looked up by digest."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self._by_digest = {_digest(t): tenant for t, tenant in tokens.items()}

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TokenTable:
        return cls(parse_tokens(Path(path).read_text()))

    @classmethod
    def from_digests(cls, digests: Iterable[str], tenant: str) -> TokenTable:
        """A table that knows its tokens only by their hex SHA-256 (all for one tenant)."""
        table = cls({})
        table._by_digest = {bytes.fromhex(d): tenant for d in digests}
        return table

    @property
    def tenants(self) -> set[str]:
        return set(self._by_digest.values())

    def tenant(self, token: str) -> str | None:
        return self._by_digest.get(_digest(token))


class KeptAnswers:
    """Answers to a question asked once per key and kept a while (a token's verdict, a replica's
    certificate): `get` returns the kept answer while it is fresh; else it awaits `ask()`, which
    callers of that key at once share, and keeps the answer for `keep_s(answer)` seconds (0: not
    kept). At most `most` keys are kept, the least recently used going first."""

    def __init__(self, most: int = 4096) -> None:
        self.most = most
        self._kept: OrderedDict[Hashable, tuple[object, float]] = OrderedDict()  # key -> (answer, until)
        self._asking: dict[Hashable, asyncio.Future] = {}

    async def get(self, key: Hashable, ask: Callable[[], Awaitable], keep_s: Callable[[object], float]):
        kept = self._kept.get(key)
        if kept is not None and time.monotonic() < kept[1]:
            self._kept.move_to_end(key)
            return kept[0]
        if key in self._asking:
            return await asyncio.shield(self._asking[key])
        future = self._asking[key] = asyncio.get_running_loop().create_future()
        try:
            answer = await ask()
            seconds = keep_s(answer)
            if seconds > 0:
                self._kept[key] = (answer, time.monotonic() + seconds)
                self._kept.move_to_end(key)
                while len(self._kept) > self.most:
                    self._kept.popitem(last=False)
            future.set_result(answer)
            return answer
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no warning when nobody else waited
            raise
        finally:
            del self._asking[key]


def bearer_token(metadata: Iterable[tuple[str, object]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry; "" when the entry is malformed."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def peer_names(auth_context: Mapping[str, Sequence[bytes]] | None) -> set[str]:
    """The names the caller's certificate carries (its SANs and common name); none without one."""
    names: set[str] = set()
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        for value in (auth_context or {}).get(key, ()):
            names.add(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    return names


class BearerGuard:
    """Checks a call's caller before its handler runs; sets TENANT.

    With `client_id`, a caller whose certificate does not name it: PERMISSION_DENIED.
    Missing token: UNAUTHENTICATED. A token the table does not hold: PERMISSION_DENIED.
    With no table every caller (who passed the identity check) is the anonymous tenant.
    """

    def __init__(self, table: TokenTable | None, *, what: str = "token", client_id: str = "") -> None:
        self.table = table
        self.what = what
        self.client_id = client_id

    def __call__(self, method: str, metadata, peer: Mapping[str, Sequence[bytes]] | None = None) -> None:
        if method.startswith(OPEN_METHOD_PREFIXES):
            TENANT.set(ANONYMOUS)
            return
        if self.client_id and self.client_id not in peer_names(peer):
            raise PermissionDenied("this service accepts only the orchestrators' certificate",
                                   detail=f"the client certificate names {sorted(peer_names(peer))}")
        if self.table is None:
            TENANT.set(ANONYMOUS)
            return
        token = bearer_token(metadata)
        if not token:
            raise Unauthenticated(f"missing credentials: send 'authorization: Bearer <{self.what}>'")
        tenant = self.table.tenant(token)
        if tenant is None:
            raise PermissionDenied(f"the {self.what} is not accepted")
        TENANT.set(tenant)


# ------------------------------------------------------------------ server flags


@dataclass(frozen=True)
class ServerSecurity:
    """What a server's flags say about TLS, tokens and binding beyond loopback."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # require client certificates signed by it (mTLS)
    tls_client_id: str = ""  # model services: the one client certificate name accepted ("" = any)
    auth_tokens: str = ""  # orchestrator: the tenants' token file
    service_token: str = ""  # model services: the token orchestrators send
    service_token_sha256: str = ""  # model services: that token's SHA-256 (hex, comma-separated)
    insecure: bool = False  # allow a non-loopback bind without TLS and tokens

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def authenticated(self) -> bool:
        return bool(self.auth_tokens or self.service_token or self.service_token_sha256
                    or self.tls_client_ca)

    def credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca)

    def guard(self) -> BearerGuard:
        if self.auth_tokens:
            return BearerGuard(TokenTable.from_file(self.auth_tokens), what="token")
        client_id = self.tls_client_id if self.tls_client_ca else ""
        digests = parse_digests(self.service_token_sha256)
        if self.service_token:
            digests.append(token_sha256(self.service_token))
        if digests:
            return BearerGuard(TokenTable.from_digests(digests, "orchestrator"), what="service token",
                               client_id=client_id)
        return BearerGuard(None, client_id=client_id)

    def check_bind(self, host: str) -> None:
        """Refuse a non-loopback bind with neither TLS nor tokens unless --insecure (then warn)."""
        if is_loopback(host):
            return
        if not (self.tls or self.authenticated):
            if not self.insecure:
                raise SystemExit(
                    f"refusing to bind {host} without TLS or tokens: give --tls-cert/--tls-key "
                    "and/or tokens, bind 127.0.0.1, or pass --insecure"
                )
            log.warning("binding %s with neither TLS nor tokens (--insecure): anyone who can "
                        "reach this port has full access", host)
        elif not self.tls:
            log.warning("binding %s without TLS: tokens and data cross the network in clear", host)


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    tenants = hasattr(args, "auth_tokens")  # the orchestrator: its --service-token is outgoing
    return ServerSecurity(
        tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
        tls_client_ca=args.tls_client_ca or "",
        tls_client_id="" if tenants else (getattr(args, "tls_client_id", "") or ""),
        auth_tokens=(args.auth_tokens or "") if tenants else "",
        service_token="" if tenants else (getattr(args, "service_token", "") or ""),
        service_token_sha256="" if tenants else (getattr(args, "service_token_sha256", "") or ""),
        insecure=bool(args.insecure),
    )


# ------------------------------------------------------------------ outgoing (orchestrator)


@dataclass(frozen=True)
class ServiceClientSecurity:
    """How the orchestrator reaches the model services: TLS trust, client cert, service token."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = ""

    def credentials(self) -> grpc.ChannelCredentials | None:
        return channel_credentials(self.ca, self.cert, self.key)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.token)


def service_client_from_args(args: argparse.Namespace) -> ServiceClientSecurity:
    return ServiceClientSecurity(ca=args.service_tls_ca or "", cert=args.service_tls_cert or "",
                                 key=args.service_tls_key or "", token=args.service_token or "")

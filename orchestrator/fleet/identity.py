"""Whether a model replica is what it is routed as: its certificate names its role.

With TLS to the model services, `specdec secrets` gives each role's server certificate the URI
SAN spiffe://specdec/<role>. The registry says which role an entry claims, and any pod whose
Redis login can write that role's keys can claim it; the certificate cannot be claimed, since
only the CA signs it. So before a replica gets its first session as a target (or a draft), one
TLS handshake reads its certificate, and a replica whose certificate does not name that role is
never routed to (one log line). Verdicts are kept per (address, role) for `keep_s`.

--service-role-id sets the name each role's certificate must carry ('{role}' stands for the
role); empty turns the check off (a PKI of your own whose certificates name no role).
"""
from __future__ import annotations

import asyncio
import logging
import ssl

from specdec.runtime.security import KeptAnswers, ServiceClientSecurity

log = logging.getLogger(__name__)
DEFAULT_ROLE_ID = "spiffe://specdec/{role}"


def certificate_names(cert: dict) -> set[str]:
    """The URI and DNS names of a certificate as ssl.SSLSocket.getpeercert() gives it."""
    return {value for kind, value in cert.get("subjectAltName", ()) if kind in ("URI", "DNS")}


class PeerRoles:
    """(address, role) -> whether that replica's certificate names the role; asked once per `keep_s`."""

    def __init__(self, security: ServiceClientSecurity, role_id: str = DEFAULT_ROLE_ID,
                 keep_s: float = 300.0, timeout_s: float = 5.0) -> None:
        self.security, self.role_id, self.keep_s, self.timeout_s = security, role_id, keep_s, timeout_s
        self._answers = KeptAnswers()

    @property
    def on(self) -> bool:
        return bool(self.security.ca and self.role_id)

    async def named(self, address: str, role: str) -> bool:
        """True when the replica at `address` presents a certificate naming `role` (or the check is off)."""
        if not self.on:
            return True
        ok, _ = await self._answers.get((address, role), lambda: self._ask(address, role),
                                        lambda answer: answer[1])
        return ok

    async def _ask(self, address: str, role: str) -> tuple[bool, float]:
        """(whether the certificate names the role, how long that answer is kept)."""
        wanted = self.role_id.format(role=role)
        try:
            names = await asyncio.wait_for(self._names(address), self.timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ValueError) as exc:
            # Unreachable or mid-restart: not routed this time, asked again soon (not kept long).
            log.warning("%s replica %s: its certificate could not be read (%s); not routed to it",
                        role, address, exc or type(exc).__name__)
            return False, min(self.keep_s, 5.0)
        ok = wanted in names
        if not ok:
            log.warning("%s replica %s: its certificate names %s, not %s; never routed to it as a %s",
                        role, address, sorted(names) or "nothing", wanted, role)
        return ok, self.keep_s

    async def _names(self, address: str) -> set[str]:
        host, _, port = address.rpartition(":")
        context = ssl.create_default_context(cafile=self.security.ca)
        context.check_hostname = False  # the channel checks the host name; this, the role
        context.set_alpn_protocols(["h2"])  # gRPC servers refuse a TLS client that offers no h2
        if self.security.cert and self.security.key:
            context.load_cert_chain(self.security.cert, self.security.key)
        _, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=context)
        try:
            return certificate_names(writer.get_extra_info("peercert") or {})
        finally:
            writer.close()

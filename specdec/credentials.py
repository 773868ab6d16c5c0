"""`specdec secrets DIR`: the TLS certificates and tokens a secured deployment needs.

    specdec secrets ./secrets [--host target --host draft ...] [--tenant alice ...]

writes, each file mode 0600 in a 0700 folder (existing files are kept unless --force):

    ca.crt                 the deployment's own CA (its key, ca.key, signs nothing else)
    server.crt/server.key  one certificate for every server (SANs: --host names, localhost, 127.0.0.1)
    client.crt/client.key  the orchestrator's client certificate (mutual TLS to the services)
    tokens                 tenant:token lines for the orchestrator (--auth-tokens)
    specdec.env            SPECDEC_SERVICE_TOKEN and SPECDEC_REDIS_PASSWORD (compose env_file)
    redis.conf             Redis on TLS only, with that password (paths as compose mounts them)

and prints one client token. Nothing here is for production PKI: it is a
private CA that lives as long as the folder does.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets as random
import sys
from pathlib import Path

DEFAULT_HOSTS = ("localhost", "target", "draft", "target-cpu", "draft-cpu", "orchestrator", "redis",
                 "gateway")


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=(), client=False,
          days: int = 825):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer_name or name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        names = []
        for san in sans:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(san)))
            except ValueError:
                names.append(x509.DNSName(san))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [
            ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def generate(folder: Path, *, hosts=DEFAULT_HOSTS, tenants=("default",), force: bool = False) -> dict:
    """Write the files above into `folder`; returns {tenant: token}."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    if (folder / "ca.crt").exists() and not force:
        raise FileExistsError(f"{folder} already holds secrets; --force replaces them")
    ca_key = _key()
    ca = _cert("specdec CA", ca_key, None, ca_key, ca=True, days=3650)
    server_key, client_key = _key(), _key()
    server = _cert("specdec server", server_key, ca.subject, ca_key, ca=False,
                   sans=[*hosts, "localhost", "127.0.0.1"])
    client = _cert("specdec orchestrator", client_key, ca.subject, ca_key, ca=False, client=True)
    _write(folder / "ca.crt", _pem_cert(ca))
    _write(folder / "ca.key", _pem_key(ca_key))
    _write(folder / "server.crt", _pem_cert(server))
    _write(folder / "server.key", _pem_key(server_key))
    _write(folder / "client.crt", _pem_cert(client))
    _write(folder / "client.key", _pem_key(client_key))
    tokens = {tenant: random.token_urlsafe(32) for tenant in tenants}
    _write(folder / "tokens", "".join(f"{t}:{tok}\n" for t, tok in tokens.items()).encode())
    redis_password = random.token_urlsafe(24)
    _write(folder / "specdec.env", (
        f"SPECDEC_SERVICE_TOKEN={random.token_urlsafe(32)}\n"
        f"SPECDEC_REDIS_PASSWORD={redis_password}\n"
    ).encode())
    _write(folder / "redis.conf", (  # paths as compose.yaml mounts the folder
        "port 0\ntls-port 6379\ntls-auth-clients no\n"
        "tls-cert-file /secrets/server.crt\ntls-key-file /secrets/server.key\n"
        f"tls-ca-cert-file /secrets/ca.crt\nrequirepass {redis_password}\n"
    ).encode())
    return tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec secrets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--host", action="append", default=[],
                   help=f"server name for the certificate (repeatable; default {', '.join(DEFAULT_HOSTS)})")
    p.add_argument("--tenant", action="append", default=[], help="tenant to make a token for "
                   "(repeatable; default 'default')")
    p.add_argument("--force", action="store_true", help="replace existing secrets")
    args = p.parse_args(argv)
    try:
        tokens = generate(Path(args.folder), hosts=args.host or DEFAULT_HOSTS,
                          tenants=args.tenant or ("default",), force=args.force)
    except FileExistsError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote {args.folder}/: ca.crt, server.crt/key, client.crt/key, tokens, specdec.env, "
          "redis.conf",
          file=sys.stderr)
    for tenant, token in tokens.items():
        print(f"{tenant}: {token}")
    return 0

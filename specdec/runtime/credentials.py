"""`specdec secrets DIR`: per-role certificates, keys and tokens for a secured deployment.

    specdec secrets ./secrets [--host NAME | --host ROLE=NAME ...] [--tenant alice ...]
    specdec secrets ./secrets --rotate          # new keys, certificates, service token, Redis passwords
    specdec secrets ./secrets --rotate-ca       # trust a new CA next to the old one (signs from now on)
    specdec secrets ./secrets --drop-previous   # stop accepting what the last rotation replaced

DIR (mode 0700) holds one folder per role with only the files that role needs;
each container or pod mounts its own folder and nothing else:

    ca.crt, ca.key   the CA; ca.key signs the certificates below and is mounted nowhere.
                     ca.crt is the trust bundle: the signing CA, then (after --rotate-ca,
                     until --drop-previous) the one before it
    state.json       the current secrets and the digests still accepted (for rotations); mounted nowhere
    orchestrator/    ca.crt, server.crt/key (server use only), client.crt/key (the one client
                     certificate: spiffe://specdec/orchestrator), tokens (tenant:token lines),
                     orchestrator.env (SPECDEC_SERVICE_TOKEN, its Redis user and password)
    target/, draft/  ca.crt, server.crt/key (server use only; its URI SAN names the role:
                     spiffe://specdec/target or .../draft), model.env (the service token's SHA-256,
                     never the token; the role's own Redis user, which may write only that role's
                     registry keys)
    redis/           ca.crt, server.crt/key, redis.conf (TLS only; ACL users, passwords as SHA-256;
                     --redis-maxmemory with maxmemory-policy volatile-lru: only keys with a TTL
                     are evicted, least recently used first, i.e. idle sessions' records)
    gateway/         ca.crt

Role folders are 0755 and their files 0644 so that a container's non-root user
can read the folder it mounts; DIR itself (0700) keeps every other user on the
host out. ca.key and state.json are 0600. Prints one client token. Nothing here
is production PKI: a private CA that lives as long as the folder does.

Rotation (docs/security.md): --rotate, then restart Redis, the model services,
the orchestrators, in that order (each accepts the old and the new secrets, so
nothing breaks mid-way); --drop-previous once everything runs on the new ones.
A CA: --rotate-ca (restart everything: all trust both CAs), --rotate (leaves
from the new CA), --drop-previous.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import json
import os
import re
import secrets as random
import sys
from collections.abc import Iterable
from pathlib import Path

ORCHESTRATOR_ID = "spiffe://specdec/orchestrator"  # the client certificate the model services accept
SERVER_ROLES = ("orchestrator", "target", "draft", "redis")
ROLES = (*SERVER_ROLES, "gateway")
# compose.yaml's names: its service names, and <container hostname>.<role network>, which each model
# replica advertises (so that every replica of a scaled service is dialed at its own address).
DEFAULT_HOSTS = {"orchestrator": ("orchestrator",), "target": ("target", "target-cpu", "*.target.specdec"),
                 "draft": ("draft", "draft-cpu", "*.draft.specdec"), "redis": ("redis",)}
LOOPBACK_NAMES = ("localhost", "127.0.0.1")  # every server: the in-container probes dial these
# One Redis user per role: a model service's may write only its own role's registry keys, so a
# draft pod's credentials cannot announce a target (nor delete the targets' index).
REDIS_USERS = {"orchestrator": "orchestrator", "target": "target", "draft": "draft"}
LEGACY_REDIS_USERS = ("model",)  # the shared model user of older folders: accepted until --drop-previous
DEFAULT_PREFIX = "specdec:"
# Redis's memory bound (under the Kubernetes pod's 1 GiB limit, with room for copy-on-write).
DEFAULT_REDIS_MAXMEMORY = "512mb"
# What the single-certificate layout kept at the top of DIR (every container mounted all of it).
LEGACY_FILES = ("server.crt", "server.key", "client.crt", "client.key", "tokens", "specdec.env",
                "redis.conf")


# ------------------------------------------------------------------ certificates


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


def _general_name(name: str):
    from cryptography import x509

    if "://" in name:
        return x509.UniformResourceIdentifier(name)
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=(), client=False,
          days: int = 825):
    """A CA, or a leaf for server use only or (client=True) client use only."""
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
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                        critical=False)
        return builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True).sign(issuer_key, hashes.SHA256())
    builder = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    if sans:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(s) for s in dict.fromkeys(sans)]), critical=False)
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    return (builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(issuer_key, hashes.SHA256()))


def _new_ca():
    """(PEM certificate, key) of a new CA; its name is its own (a bundle of two CAs of one name
    would leave the verifier trying the wrong one)."""
    key = _key()
    name = f"specdec CA {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} {random.token_hex(4)}"
    return _pem_cert(_cert(name, key, None, key, ca=True, days=3650)), key


def _signing_ca(folder: Path):
    """(certificate, key) of the CA that signs: ca.key and the first certificate of ca.crt."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    bundle = x509.load_pem_x509_certificates((folder / "ca.crt").read_bytes())
    return bundle[0], load_pem_private_key((folder / "ca.key").read_bytes(), password=None)


def _bundle(folder: Path) -> list[bytes]:
    from cryptography import x509

    return [_pem_cert(c) for c in x509.load_pem_x509_certificates((folder / "ca.crt").read_bytes())]


# ------------------------------------------------------------------ files


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _private(path: Path, data: bytes) -> None:
    _write(path, data, 0o600)


def _role_dir(folder: Path, role: str) -> Path:
    path = folder / role
    path.mkdir(exist_ok=True)
    os.chmod(path, 0o755)
    return path


def role_hosts(hosts: Iterable[str]) -> dict[str, list[str]]:
    """{server role: certificate names} from --host values: ROLE=NAME for one role, NAME for all.

    No --host at all: DEFAULT_HOSTS (compose's service names). Every role also gets localhost
    and 127.0.0.1 (its probes)."""
    hosts = list(hosts)
    out: dict[str, list[str]] = {role: [] for role in SERVER_ROLES}
    if not hosts:
        out = {role: list(names) for role, names in DEFAULT_HOSTS.items()}
    for entry in hosts:
        role, sep, name = entry.partition("=")
        if not sep:
            for names in out.values():
                names.append(entry)
        elif role in out and name:
            out[role].append(name)
        else:
            raise ValueError(f"--host {entry}: ROLE=NAME needs a role of {', '.join(SERVER_ROLES)}")
    return {role: [*names, *LOOPBACK_NAMES] for role, names in out.items()}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _accepting(new: str, accepted: list[str]) -> list[str]:
    """Digests accepted after a rotation: the new one, and the one it replaces."""
    return [_sha256(new), *accepted[:1]]


def _load_state(folder: Path) -> dict:
    path = folder / "state.json"
    if not path.exists():
        older = (folder / "server.key").exists()
        raise FileNotFoundError(
            f"{folder} holds " + ("secrets of the single-certificate layout: --force replaces them "
                                  "(every process restarts at once)" if older
                                  else "no secrets made by `specdec secrets` (no state.json)"))
    return json.loads(path.read_text())


# ------------------------------------------------------------------ what each role gets


def _redis_conf(state: dict) -> bytes:
    """TLS only; no default user; the orchestrators own the prefix, model services only the registry.
    A memory bound that evicts only keys with a TTL (every key specdec writes has one), least
    recently used first: idle sessions' records, which a client rebuilds by sending the whole
    conversation again; the registry is rewritten every heartbeat (docs/operations.md)."""
    prefix = state["redis_prefix"]

    def passwords(user: str) -> str:
        return " ".join(f"#{h}" for h in state["redis"][user]["sha256"])

    return (  # paths as each role's folder is mounted: /secrets
        "port 0\ntls-port 6379\ntls-auth-clients no\n"
        "tls-cert-file /secrets/server.crt\ntls-key-file /secrets/server.key\n"
        "tls-ca-cert-file /secrets/ca.crt\n"
        f"maxmemory {state.get('redis_maxmemory', DEFAULT_REDIS_MAXMEMORY)}\n"
        "maxmemory-policy volatile-lru\nmaxmemory-samples 10\n"
        "user default off\n"
        f"user orchestrator on {passwords('orchestrator')} ~{prefix}* resetchannels "
        "+@all -@admin -@dangerous\n"
        + "".join(_model_user(user, passwords(user), keys) for user, keys in (
            ("target", f"~{prefix}service:target:* ~{prefix}services:target"),
            ("draft", f"~{prefix}service:draft:* ~{prefix}services:draft"),
            *((legacy, f"~{prefix}service:* ~{prefix}services:*") for legacy in LEGACY_REDIS_USERS
              if legacy in state["redis"])))
    ).encode()


def _model_user(user: str, passwords: str, keys: str) -> str:
    """A model service's Redis user: its keys only, and only what a heartbeat does."""
    return (f"user {user} on {passwords} {keys} resetchannels "
            "-@all +ping +hello +select +multi +exec +discard +set +zadd +pexpire +del +zrem\n")


def _env_files(state: dict) -> dict[str, bytes]:
    """{role: its .env file}: the orchestrators hold the service token, the model services its digest."""
    def redis_login(role: str) -> str:
        user = REDIS_USERS[role]
        return f"SPECDEC_REDIS_USERNAME={user}\nSPECDEC_REDIS_PASSWORD={state['redis'][user]['password']}\n"

    model = f"SPECDEC_SERVICE_TOKEN_SHA256={','.join(state['service_token_sha256'])}\n"
    return {"orchestrator": f"SPECDEC_SERVICE_TOKEN={state['service_token']}\n" + redis_login("orchestrator"),
            "target": model + redis_login("target"), "draft": model + redis_login("draft")}


def _write_config(folder: Path, state: dict) -> None:
    """Everything that follows from the state and the trust bundle: env files, redis.conf, ca.crt."""
    bundle = b"".join(_bundle(folder))
    for role in ROLES:
        _write(_role_dir(folder, role) / "ca.crt", bundle)
    for role, text in _env_files(state).items():
        _write(folder / role / ("orchestrator.env" if role == "orchestrator" else "model.env"), text.encode())
    _write(folder / "redis" / "redis.conf", _redis_conf(state))
    _private(folder / "state.json", json.dumps(state, indent=1).encode())


def _issue_leaves(folder: Path, hosts: dict[str, list[str]]) -> None:
    """A server certificate per server role (its own names only) and the orchestrators' client one."""
    ca, ca_key = _signing_ca(folder)
    for role in SERVER_ROLES:
        key = _key()
        cert = _cert(f"specdec {role}", key, ca.subject, ca_key, ca=False,
                     sans=[*hosts[role], f"spiffe://specdec/{role}"])
        _write(_role_dir(folder, role) / "server.crt", _pem_cert(cert))
        _write(folder / role / "server.key", _pem_key(key))
    key = _key()
    client = _cert("specdec orchestrator", key, ca.subject, ca_key, ca=False, client=True,
                   sans=[ORCHESTRATOR_ID])
    _write(folder / "orchestrator" / "client.crt", _pem_cert(client))
    _write(folder / "orchestrator" / "client.key", _pem_key(key))


def _token(nbytes: int) -> str:
    """A random URL-safe token that never starts with "-" (1 in 64 of token_urlsafe's would, and a
    command line would then read `--service-token -x...` as another flag)."""
    while (token := random.token_urlsafe(nbytes)).startswith("-"):
        pass
    return token


def _new_secrets(state: dict) -> dict:
    """The state with a fresh service token and Redis passwords (the replaced ones still accepted)."""
    token = _token(32)
    redis = {}
    for user in dict.fromkeys(REDIS_USERS.values()):
        password = _token(24)
        old = state.get("redis", {}).get(user, {}).get("sha256", [])
        redis[user] = {"password": password, "sha256": _accepting(password, old)}
    for legacy in LEGACY_REDIS_USERS:  # running model services still log in with it until restarted
        if legacy in state.get("redis", {}):
            redis[legacy] = {"password": "", "sha256": state["redis"][legacy]["sha256"][:1]}
    return {**state, "service_token": token,
            "service_token_sha256": _accepting(token, state.get("service_token_sha256", [])),
            "redis": redis}


# ------------------------------------------------------------------ the operations


def generate(folder: Path, *, hosts: Iterable[str] = (), tenants=("default",), force: bool = False,
             redis_prefix: str = DEFAULT_PREFIX, redis_maxmemory: str = DEFAULT_REDIS_MAXMEMORY) -> dict:
    """Write a new CA and every role's files into `folder`; returns {tenant: token}."""
    if not re.fullmatch(r"[0-9]+(k|kb|m|mb|g|gb)?", redis_maxmemory.lower()):
        raise ValueError(f"--redis-maxmemory: {redis_maxmemory!r} is not a Redis size (e.g. 512mb)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    if (folder / "ca.crt").exists() and not force:
        raise FileExistsError(f"{folder} already holds secrets; --rotate renews them, --force replaces them")
    for name in LEGACY_FILES:  # keys nothing mounts any more must not linger
        (folder / name).unlink(missing_ok=True)
    ca, ca_key = _new_ca()
    _private(folder / "ca.key", _pem_key(ca_key))
    _write(folder / "ca.crt", ca)
    state = _new_secrets({"hosts": role_hosts(hosts), "redis_prefix": redis_prefix,
                          "redis_maxmemory": redis_maxmemory})
    _issue_leaves(folder, state["hosts"])
    tokens = {tenant: _token(32) for tenant in tenants}
    _write(_role_dir(folder, "orchestrator") / "tokens",
           "".join(f"{t}:{tok}\n" for t, tok in tokens.items()).encode())
    _write_config(folder, state)
    return tokens


def rotate(folder: Path, *, hosts: Iterable[str] = ()) -> None:
    """New leaf keys and certificates, service token and Redis passwords; the replaced token and
    passwords stay accepted until drop_previous. Tenant tokens are kept."""
    folder = Path(folder)
    state = _load_state(folder)
    hosts = list(hosts)
    if hosts:
        state["hosts"] = role_hosts(hosts)
    state = _new_secrets(state)
    _issue_leaves(folder, state["hosts"])
    _write_config(folder, state)


def rotate_ca(folder: Path) -> None:
    """A new CA, first in every trust bundle (so it signs from now on), the old one kept after it."""
    folder = Path(folder)
    state = _load_state(folder)
    new, ca_key = _new_ca()
    old = _bundle(folder)[:1]
    _private(folder / "ca.key", _pem_key(ca_key))
    _write(folder / "ca.crt", new + b"".join(old))
    _write_config(folder, state)


def drop_previous(folder: Path) -> None:
    """Accept only the current service token, Redis passwords and CA."""
    folder = Path(folder)
    state = _load_state(folder)
    state["service_token_sha256"] = state["service_token_sha256"][:1]
    for legacy in LEGACY_REDIS_USERS:
        state["redis"].pop(legacy, None)
    for user in state["redis"].values():
        user["sha256"] = user["sha256"][:1]
    _write(folder / "ca.crt", _bundle(folder)[0])
    _write_config(folder, state)


ROLLOUT = ("then restart, in this order: Redis, the model services (target, draft), the "
           "orchestrators, the gateways; each accepts both the old and the new secrets until "
           "`specdec secrets {folder} --drop-previous`")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec secrets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--host", action="append", default=[],
                   help="a name for the server certificates: NAME (every role's) or ROLE=NAME (one "
                   "role's: orchestrator, target, draft, redis); repeatable; default "
                   + ", ".join(f"{r}={n}" for r, names in DEFAULT_HOSTS.items() for n in names))
    p.add_argument("--tenant", action="append", default=[], help="tenant to make a token for "
                   "(repeatable; default 'default')")
    p.add_argument("--redis-prefix", default=DEFAULT_PREFIX,
                   help="the deployment's --redis-prefix, which the Redis users' key patterns name")
    p.add_argument("--redis-maxmemory", default=DEFAULT_REDIS_MAXMEMORY,
                   help="redis.conf's maxmemory (evicting idle sessions' records past it: volatile-lru)")
    p.add_argument("--force", action="store_true", help="replace existing secrets (a new CA: "
                   "every process must restart at once)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rotate", action="store_true", help="new keys, certificates, service token "
                      "and Redis passwords; the old token and passwords stay accepted")
    mode.add_argument("--rotate-ca", action="store_true", help="trust a new CA beside the old one; "
                      "the next --rotate issues from it")
    mode.add_argument("--drop-previous", action="store_true",
                      help="stop accepting what the last rotation replaced")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    try:
        if args.rotate or args.rotate_ca or args.drop_previous:
            if args.rotate:
                rotate(folder, hosts=args.host)
            elif args.rotate_ca:
                rotate_ca(folder)
            else:
                drop_previous(folder)
            print(f"rewrote {folder}/; " + ("restart every process" if args.drop_previous
                                             else ROLLOUT.format(folder=folder)), file=sys.stderr)
            return 0
        tokens = generate(folder, hosts=args.host, tenants=args.tenant or ("default",),
                          force=args.force, redis_prefix=args.redis_prefix,
                          redis_maxmemory=args.redis_maxmemory)
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote {folder}/: ca.crt, ca.key (mounted nowhere), and one folder per role: "
          + ", ".join(f"{r}/" for r in ROLES), file=sys.stderr)
    for tenant, token in tokens.items():
        print(f"{tenant}: {token}")
    return 0

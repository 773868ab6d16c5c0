"""Every process's settings, defined once: the flag, its default, its help and its environment name.

A `Flag` is one setting. `Group`s of flags make up a process's `Settings`, and
the settings make everything else: the argparse parser (so `--help`), the
SPECDEC_* environment lookup, and the configuration reference page
(docs/configuration.md, `make config-docs`; a test fails when the page
drifts from the definitions). The groups every server shares (server,
security, calls to the model services, limits) are defined here; each process
defines its own groups next to its entry point (model_service.settings,
orchestrator.api.settings, gateway.settings, launcher.cli, distill.cli).

The rules:
- a flag `--max-batch-tokens` is read from SPECDEC_MAX_BATCH_TOKENS when not given (flags win);
  a process whose settings have `env=False` (distill, an offline tool) reads none;
- a switch (`--x/--no-x`) set in the environment is on for 1/true/yes/on and
  off for 0/false/no/off; an on-only flag (`--x`) is on for 1/true/yes/on;
- an old name stays as a deprecated alias (flag or environment name): it
  still works, warns once, and is listed on the reference page.

Plain dataclasses rather than pydantic-settings: the processes keep their
argparse parsers (subcommands, `--x/--no-x` switches, repeated flags,
positional arguments, Namespaces the tests and the launcher read), and what
they need on top is a record per flag that generates the argument, the
environment name and the page row.
"""
from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specdec.runtime.credentials import ORCHESTRATOR_ID

ENV_PREFIX = "SPECDEC_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

VALUE, SWITCH, ON, APPEND, POSITIONAL = "value", "switch", "on", "append", "positional"


def env_name(flag: str) -> str:
    """The environment name of `--flag`: SPECDEC_ + its name upper-cased, dashes as underscores."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def deprecated(old: str, new: str) -> None:
    """Warn (once per name, to stderr) that an old flag or environment name was used."""
    warnings.warn(f"{old} is deprecated; use {new}", FutureWarning, stacklevel=3)


@dataclass(frozen=True)
class Flag:
    """One setting of one process.

    kind: VALUE (`--name VALUE`), SWITCH (`--name/--no-name`), ON (`--name`,
    off unless given), APPEND (repeatable; the environment gives one entry),
    POSITIONAL (no dashes, no environment name).
    `default` is what the page and --help show; `default_doc` replaces it
    there where the real default is computed (e.g. the CPU count).
    """

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    kind: str = VALUE
    choices: Sequence[str] | None = None
    required: bool = False
    env: bool = True  # False: a per-request option, never read from the environment
    default_doc: str = ""
    metavar: str | None = None
    nargs: str | None = None  # POSITIONAL only: "?" makes it optional
    aliases: tuple[str, ...] = ()  # deprecated flag names (without dashes; not for switches)
    env_aliases: tuple[str, ...] = ()  # deprecated environment names (full)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def option(self) -> str:
        return self.name if self.kind == POSITIONAL else ("-" if len(self.name) == 1 else "--") + self.name

    @property
    def options(self) -> str:
        """How the flag is written on the page: `--x`, `--x/--no-x`, `NAME`."""
        if self.kind == SWITCH:
            return f"--{self.name}/--no-{self.name}"
        return self.name.upper() if self.kind == POSITIONAL else self.option

    def has_env(self, settings: Settings) -> bool:
        return settings.env and self.env and self.kind != POSITIONAL

    def default_text(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.kind in (SWITCH, ON):
            return "on" if self.default else "off"
        if self.required:
            return "required"
        if self.default is None or self.default == "" or self.default == []:
            return "none"
        return str(self.default)

    def help_text(self, settings: Settings) -> str:
        """--help's text: the help, the environment name, the default (the page's row in one line)."""
        parts = [self.help]
        if self.has_env(settings):
            parts.append(f"[{env_name(self.name)}]")
        if self.kind != POSITIONAL or self.nargs == "?":
            parts.append(f"(default: {self.default_text()})")
        return " ".join(parts).replace("%", "%%")

    # ---------------------------------------------------------------- environment

    def env_value(self, environ: Mapping[str, str]) -> str | None:
        """This flag's environment value, from its name or (warning) a deprecated one."""
        name = env_name(self.name)
        if name in environ:
            return environ[name]
        for old in self.env_aliases:
            if old in environ:
                deprecated(old, name)
                return environ[old]
        return None

    def initial(self, settings: Settings, environ: Mapping[str, str]) -> Any:
        """The parser's default: the environment's value where there is one, else `default`."""
        value = self.env_value(environ) if self.has_env(settings) else None
        if value is None:
            return list(self.default or []) if self.kind == APPEND else self.default
        if self.kind == SWITCH:
            v = value.strip().lower()
            return v not in FALSE if self.default else v in TRUE
        if self.kind == ON:
            return value.strip().lower() in TRUE
        if self.kind == APPEND:
            return [value]
        return value  # a string: argparse applies `type` to string defaults

    # ---------------------------------------------------------------- argparse

    def add_to(self, group: Any, settings: Settings, environ: Mapping[str, str]) -> None:
        kwargs: dict[str, Any] = {"help": self.help_text(settings)}
        if self.kind == POSITIONAL:
            group.add_argument(self.name, nargs=self.nargs, default=self.default, choices=self.choices, **kwargs)
            return
        default = self.initial(settings, environ)
        if self.kind == SWITCH:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif self.kind == ON:
            kwargs["action"] = "store_true"
        else:
            kwargs["action"] = "append" if self.kind == APPEND else "store"
            kwargs.update(type=self.type, choices=self.choices, metavar=self.metavar)
            # Required only where the environment gives nothing.
            kwargs["required"] = self.required and default is None
        group.add_argument(self.option, dest=self.dest, default=default, **kwargs)
        for old in self.aliases:
            alias = {k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar")}
            group.add_argument(("-" if len(old) == 1 else "--") + old, dest=self.dest, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS, action=_deprecated_action(kwargs["action"], self.option),
                               **alias)


def _deprecated_action(base: Any, new: str) -> type[argparse.Action]:
    """An argparse action like `base` that warns that its option string is an old name."""
    parent = {"store": argparse._StoreAction, "append": argparse._AppendAction,
              "store_true": argparse._StoreTrueAction}[base]

    class Deprecated(parent):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            deprecated(option_string or "", new)
            super().__call__(parser, namespace, values, option_string)

    return Deprecated


@dataclass(frozen=True)
class Group:
    title: str
    flags: tuple[Flag, ...]
    description: str | None = None

    def with_defaults(self, **defaults: Any) -> Group:
        """The same group with other defaults (by dest name), e.g. a process's own port."""
        return replace(self, flags=tuple(replace(f, default=defaults[f.dest]) if f.dest in defaults else f
                                         for f in self.flags))

    def plus(self, *flags: Flag) -> Group:
        return replace(self, flags=(*self.flags, *flags))


@dataclass(frozen=True)
class Settings:
    """One process's settings: its groups of flags, and how its --help starts."""

    prog: str
    description: str
    groups: tuple[Group, ...]
    env: bool = True  # whether the flags have SPECDEC_* names
    raw_description: bool = True
    epilog: str | None = None

    @property
    def flags(self) -> list[Flag]:
        return [f for g in self.groups for f in g.flags]

    def parser(self, environ: Mapping[str, str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
        """The argparse parser (into `parser`, e.g. a subcommand's, if given)."""
        environ = os.environ if environ is None else environ
        if parser is None:
            parser = argparse.ArgumentParser(
                prog=self.prog, description=self.description, epilog=self.epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter if self.raw_description
                else argparse.HelpFormatter)
        for group in self.groups:
            target = parser if group.title == "" else parser.add_argument_group(group.title, group.description)
            for flag in group.flags:
                flag.add_to(target, self, environ)
        return parser

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        return self.parser().parse_args(argv)

    def env_names(self) -> list[str]:
        return [env_name(f.name) for f in self.flags if f.has_env(self)]


@dataclass(frozen=True)
class EnvOnly:
    """An environment variable that is no flag's (a secret, a cache path, a launcher handshake)."""

    name: str
    help: str
    read_by: str


# Environment names no flag has; each is read where `read_by` says (and listed on the page).
ENV_ONLY = (
    EnvOnly("SPECDEC_REDIS_PASSWORD", "password for Redis (kept out of --redis-url, so it is in no "
            "process listing)", "specdec.runtime.store: every server's Redis client"),
    EnvOnly("SPECDEC_REDIS_USERNAME", "Redis ACL user (`specdec secrets` makes one per role: a model "
            "service's may write only its own role's registry keys)", "specdec.runtime.store: every server's Redis client"),
    EnvOnly("SPECDEC_CACHE_DIR", "where converted models are cached (default ~/.cache/specdec)",
            "engine.model.loader"),
    EnvOnly("SPECDEC_PARENT_PID", "set by the launcher for its children: a child stops when that "
            "process is gone", "specdec.runtime.procs"),
    EnvOnly("SPECDEC_TEST_DEVICE", "tests and benchmarks only: the device their services use",
            "specdec.runtime.launch"),
    EnvOnly("SPECDEC_PYTHON_IMAGE", "compose.yaml: the image the specdec image builds on (default "
            "python:3.11-slim; make compose-up sets specdec-base:bookworm where no registry answers)",
            "compose.yaml (build argument PYTHON_IMAGE)"),
    EnvOnly("SPECDEC_REDIS_IMAGE", "compose.yaml: Redis's image (default redis:7-alpine; make compose-up "
            "sets specdec-redis:bookworm where no registry answers)", "compose.yaml"),
    EnvOnly("SPECDEC_COMPOSE_CACHE", "make compose-up: where the Debian base's rootfs and the wheelhouse "
            "are cached (default ~/.cache/specdec/compose)", "scripts/compose.py"),
    EnvOnly("SPECDEC_DEBIAN_MIRROR", "make compose-up: the Debian mirror debootstrap builds the base from "
            "(default http://deb.debian.org/debian)", "scripts/compose.py"),
)


# ------------------------------------------------------------------ shared groups


def server_group(default_port: int) -> Group:
    """The flags every specdec gRPC server takes (specdec.runtime.server.options_from_args reads them)."""
    return SERVER.with_defaults(port=default_port)


SERVER = Group("server", (
    Flag("host", "address to bind (0.0.0.0 for all interfaces)", "127.0.0.1"),
    Flag("port", "gRPC port", 0, int),
    Flag("metrics-port", "Prometheus HTTP port, 0 = off", 0, int),
    Flag("metrics-host", "address the metrics endpoint binds (it has no authentication)", "127.0.0.1"),
    Flag("health-port", "also serve grpc.health.v1 alone, in plaintext, on 127.0.0.1:PORT (for probes "
         "inside the pod or container, which hold no client certificate); 0 = off", 0, int),
    Flag("grace", "drain deadline: seconds after SIGTERM for in-flight calls to finish and live "
         "sessions to move to other replicas before exit", 10.0, float),
    Flag("redis-url", "Redis, e.g. redis://127.0.0.1:6379/0; a model service registers itself there "
         "with a heartbeat (empty = off); the orchestrator keeps its sessions there "
         "(empty = redis://127.0.0.1:6379/0)", ""),
    Flag("redis-prefix", "key prefix in Redis", "specdec:"),
    Flag("advertise-address", "host:port other processes dial, if not --host:--port", ""),
    Flag("log-level", "DEBUG, INFO, WARNING...", "INFO"),
    Flag("event-loop", "the asyncio event loop: uvloop (libuv, in C: less CPU per scheduled callback, "
         "timer and socket write), asyncio (the standard library's), or auto: uvloop where installed",
         "auto", choices=("auto", "uvloop", "asyncio")),
    Flag("trace-file", "append OpenTelemetry spans to this JSON-lines file (one span per line); OTLP "
         "export instead: OTEL_TRACES_EXPORTER=otlp and OTEL_EXPORTER_OTLP_ENDPOINT; empty = off", ""),
    Flag("keepalive-s", "ping each connection after this many idle seconds; a peer that does not answer "
         "within --keepalive-timeout-s is dropped, and its calls cancelled (a client that died or went "
         "away without closing frees what it held); 0 = off", 60.0, float),
    Flag("keepalive-timeout-s", "how long a keepalive ping may go unanswered", 20.0, float),
    Flag("max-connection-age-s", "close each client connection after this long (GOAWAY: clients reconnect, "
         "calls in flight get --max-connection-age-grace-s to finish), so load spreads over new replicas; "
         "0 = off", 0.0, float),
    Flag("max-connection-age-grace-s", "how long calls in flight on a connection past its age may run on",
         300.0, float),
))

_TLS = (
    Flag("tls-cert", "PEM certificate (chain) this server presents; enables TLS", ""),
    Flag("tls-key", "PEM private key of --tls-cert", ""),
    Flag("tls-client-ca", "require client certificates signed by this CA (mutual TLS)", ""),
)
_INSECURE = Flag("insecure", "allow binding a non-loopback address with neither TLS nor tokens",
                 False, kind=ON)
SERVICE_TOKEN = Flag("service-token", "the token orchestrators and model services share: a model "
                     "service lets only callers sending 'authorization: Bearer <this>' call it; the "
                     "orchestrator sends it", "")

# A model service's security: TLS, the orchestrators' certificate name, and the service token
# they send (or only its SHA-256, so that a model pod holds no orchestrator credential).
SERVICE_SECURITY = Group("security", (
    *_TLS,
    Flag("tls-client-id", "with --tls-client-ca: the name (URI SAN, DNS SAN or common name) the "
         "client certificate must carry; any other certificate is PERMISSION_DENIED; empty = any "
         "certificate the CA signed", ORCHESTRATOR_ID),
    SERVICE_TOKEN,
    Flag("service-token-sha256", "accept the service token whose hex SHA-256 is this (comma-separated: "
         "several, e.g. the old and the new one during a rotation) without holding the token", ""),
    _INSECURE))
# The orchestrator's: TLS, and its tenants' tokens.
TENANT_SECURITY = Group("security", (*_TLS, Flag(
    "auth-tokens", "file of 'tenant:token' lines (or a JSON object tenant -> token(s)); callers must "
    "send 'authorization: Bearer <token>'", ""), _INSECURE))

# How the orchestrator reaches the model services (specdec.runtime.security.service_client_from_args).
SERVICE_CLIENT = Group("calls to the model services", (
    Flag("service-tls-ca", "CA that signed the model services' certificates; enables TLS to them", ""),
    Flag("service-tls-cert", "client certificate for mutual TLS with the services", ""),
    Flag("service-tls-key", "its private key", ""),
    SERVICE_TOKEN,
    Flag("service-role-id", "with --service-tls-ca: the name (URI or DNS SAN) a replica's certificate must "
         "carry to be routed to as its role ('{role}' stands for target or draft; `specdec secrets` "
         "writes these); a replica whose certificate does not is never used; empty = no check",
         "spiffe://specdec/{role}"),
))

# A client's connection to a specdec server (the gateway, specdec generate / health).
CLIENT_TLS = (
    Flag("tls-ca", "CA of the server's certificate; enables TLS", None),
    Flag("client-cert", "client certificate for mutual TLS", None, aliases=("tls-cert",)),
    Flag("client-key", "its private key", None, aliases=("tls-key",)),
)


def limits_group() -> Group:
    """The per-tenant quotas of the orchestrator (specdec.runtime.limits.tenant_limits_from_args reads them)."""
    from specdec.runtime.limits import TenantLimits

    d = TenantLimits()
    return Group("limits (RESOURCE_EXHAUSTED, counted in specdec_limit_rejections_total)", (
        Flag("max-request-bytes", "UTF-8 bytes of prompt + messages + guess + stop strings, checked "
             "before tokenising", d.max_request_bytes, int),
        Flag("max-streams-per-tenant", "concurrent streams per tenant (a Generate of n choices runs n; "
             "Check and Predict one each), 0 = off",
             d.max_streams_per_tenant, int),
        Flag("rate-per-tenant", "calls a second per tenant (token bucket), 0 = off", d.rate_per_tenant, float),
        Flag("burst-per-tenant", "token bucket size", d.burst_per_tenant, float),
        Flag("max-in-flight", "concurrent streams in all (counted as --max-streams-per-tenant), 0 = off",
             d.max_in_flight, int),
        Flag("max-kept-sessions-per-tenant", "kept (multi-turn) session records one tenant may hold in Redis; "
             "a new one past it is refused until the tenant ends one (EndSession) or one expires "
             "(--record-ttl), 0 = off", d.max_kept_sessions, int),
        Flag("max-stream-seconds", "the longest one Generate stream runs, whatever its client's deadline: "
             "past it the stream ends with DEADLINE_EXCEEDED max_stream_seconds at its next chunk, and its "
             "target slot and KV go, 0 = off", d.max_stream_s, float),
    ))


# ------------------------------------------------------------------ the reference page


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference(processes: Sequence[tuple[str, str, Settings]]) -> str:
    """docs/configuration.md: every flag of every process, with its environment name and default."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the settings definitions (specdec.runtime.settings and each process's own);",
        "     regenerate with `make config-docs`. tests/unit/test_settings.py fails when it drifts. -->",
        "",
        "Every flag of every specdec process. A flag such as `--max-batch-tokens` can also be set with",
        "the environment variable `SPECDEC_MAX_BATCH_TOKENS` (flags win). A switch `--x/--no-x` is on in the",
        "environment for `1`/`true`/`yes`/`on` and off for `0`/`false`/`no`/`off`; an on-only flag `--x`",
        "is on for `1`/`true`/`yes`/`on`. Deprecated names still work and print a warning.",
        "",
        "| process | command | flags | environment names |",
        "| --- | --- | --- | --- |",
    ]
    for title, command, settings in processes:
        lines.append(f"| [{title}](#{_anchor(title)}) | `{command}` | {len(settings.flags)} | "
                     f"{len(settings.env_names())} |")
    for title, command, settings in processes:
        lines += ["", f"## {title}", "", f"`{command}`" + ("" if settings.env else
                  " (an offline tool: its flags have no environment names)")]
        for group in settings.groups:
            lines += ["", f"### {group.title or 'arguments'}", "",
                      "| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
            for f in group.flags:
                env = f"`{env_name(f.name)}`" if f.has_env(settings) else "—"
                old = [f"`--{a}`" if len(a) > 1 else f"`-{a}`" for a in f.aliases]
                old += [f"`{e}`" for e in f.env_aliases]
                meaning = [f.help.rstrip(".")]
                if f.choices:
                    meaning.append(f"One of: {', '.join(f.choices)}")
                if old:
                    meaning.append(f"Deprecated: {', '.join(old)}")
                lines.append(f"| `{f.options}` | {env} | `{_cell(f.default_text())}` | "
                             f"{_cell('. '.join(meaning))}. |")
    lines += ["", "## Environment only", "", "| environment | meaning | read by |", "| --- | --- | --- |"]
    lines += [f"| `{e.name}` | {_cell(e.help)} | {e.read_by} |" for e in ENV_ONLY]
    return "\n".join(lines) + "\n"


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


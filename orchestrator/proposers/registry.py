"""The proposer registry: every kind of proposer, declared once.

A `ProposerKind` says a proposer's name (what requests, flags and stats call
it), its wire name (the proto enum value of the kinds that predate
`GenerateRequest.proposer_name`; newer kinds are named on the wire by their
name alone), its capabilities and where its `home` lives: "module:attribute",
imported on first use, a callable `home(config) -> ProposerHome`. A home is the
long-lived part, one per orchestrator process (a cache shared across requests
lives there); `await home.open(opening)` gives a request its `Proposer`
(orchestrator.proposers.base), the per-request part the loop talks to.

Every list of kinds derives from `kinds()`: the servicer's parsing, the
--default-proposer choices, ServedModel.proposers (which the client, the
gateway and the playground read), the benchmarks and docs/api.md's table. The
built-in kinds are `BUILTIN`; an installed package adds its own under the
entry-point group `specdec.proposers` (name = the kind's name, value =
"module:attribute" of its `ProposerKind`), the ecosystem's plugin convention.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger(__name__)
GROUP = "specdec.proposers"  # the entry-point group of third-party proposers


@dataclass(frozen=True)
class Capabilities:
    """What a kind can do; the loop and the docs read these, never the proposer's type."""

    trees: bool = False  # drafts a token tree when the round asks for one
    features: bool = False  # may draft from the target's hidden states (EAGLE-3 heads)
    parallel: bool = False  # may pre-draft the next round while the target verifies this one
    q: bool = False  # proposes with q (a model's distribution); else deterministic (one-hot q)
    own_length: bool = False  # sets its own proposal's length: the round's k (max_k by default) caps it
    shared: bool = False  # learns across requests (per tenant): its home holds state


@dataclass(frozen=True)
class ProposerKind:
    """One kind of proposer (see the module docstring)."""

    name: str
    summary: str  # one line: --help, the playground, docs/api.md
    home: str | Callable[[Any], Any]  # "module:attribute" or the callable: config -> ProposerHome
    wire: str = ""  # its value in the proto enum Proposer ("" = named by proposer_name only)
    capabilities: Capabilities = field(default_factory=Capabilities)
    requestable: bool = True  # False: a request names it through another field (the prediction)
    default_ok: bool = True  # may be the --default-proposer

    def make_home(self, config: Any) -> Any:
        target = self.home
        if isinstance(target, str):
            module, _, attribute = target.partition(":")
            target = getattr(importlib.import_module(module), attribute)
        return target(config)


_F = "orchestrator.proposers.factory"
BUILTIN = (
    ProposerKind("combined", "per round, prompt lookup or the draft model, whichever pays more",
                 f"{_F}:CombinedHome", wire="PROPOSER_COMBINED",
                 capabilities=Capabilities(trees=True, features=True, q=True)),
    ProposerKind("draft", "the draft model (a small LM or an EAGLE-3 head) on the draft service",
                 f"{_F}:DraftHome", wire="PROPOSER_DRAFT",
                 capabilities=Capabilities(trees=True, features=True, parallel=True, q=True)),
    ProposerKind("lookup", "prompt lookup: copy what followed the last n-gram in the context",
                 f"{_F}:LookupHome", wire="PROPOSER_LOOKUP", capabilities=Capabilities(trees=True)),
    ProposerKind("suffix", "suffix decoding: continue the longest match in this tenant's earlier "
                 "requests or the context", "orchestrator.proposers.suffix:SuffixHome",
                 capabilities=Capabilities(trees=True, own_length=True, shared=True)),
    ProposerKind("guess", "the caller's expected continuation (GenerateRequest.guess)",
                 f"{_F}:GuessHome", wire="PROPOSER_GUESS", default_ok=False),
    ProposerKind("none", "target-only: nothing drafted, one token per target pass",
                 f"{_F}:NoneHome", wire="PROPOSER_NONE"),
    ProposerKind("prediction", "Predicted Outputs (GenerateRequest.prediction), re-aligned after "
                 "a rejection", f"{_F}:PredictionHome", requestable=False, default_ok=False),
)


def _plugins() -> list[ProposerKind]:
    """Kinds from installed packages' `specdec.proposers` entry points (a bad one is logged, skipped)."""
    found = []
    for point in entry_points(group=GROUP):
        try:
            kind = point.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop the orchestrator
            log.error("proposer plugin %s (%s) does not load: %s", point.name, point.value, exc)
            continue
        if not isinstance(kind, ProposerKind) or kind.name != point.name:
            log.error("proposer plugin %s (%s) is not a ProposerKind named %r; skipped",
                      point.name, point.value, point.name)
            continue
        found.append(kind)
    return found


def kinds(*, plugins: bool = True) -> dict[str, ProposerKind]:
    """Every kind by name: the built-in ones, then installed plugins (which cannot replace one)."""
    out = {kind.name: kind for kind in BUILTIN}
    for kind in _plugins() if plugins else ():
        if kind.name in out:
            log.error("proposer plugin %s: the name is taken by a built-in kind; skipped", kind.name)
            continue
        out[kind.name] = kind
    return out


def names(*, plugins: bool = True, requestable: bool = True, default_ok: bool = False) -> list[str]:
    """Kind names, in registry order: those a request may name (or that may be the default)."""
    return [k.name for k in kinds(plugins=plugins).values()
            if (not requestable or k.requestable) and (not default_ok or k.default_ok)]


def plugin_names() -> list[str]:
    """The names of installed plugins' kinds, without importing them (for --help and flags)."""
    return [point.name for point in entry_points(group=GROUP)]


TABLE_START = ("<!-- proposers: generated from orchestrator.proposers.registry "
               "(scripts/gen_config_docs.py) -->")
TABLE_END = "<!-- /proposers -->"


def table(registry: dict[str, ProposerKind] | None = None) -> str:
    """docs/api.md's table of the built-in kinds, between TABLE_START and TABLE_END."""
    rows = ["| name | proto enum | what it proposes | trees | q | own length | learns across requests |",
            "|---|---|---|---|---|---|---|"]
    mark = {True: "yes", False: ""}
    for kind in (registry or kinds(plugins=False)).values():
        c = kind.capabilities
        name = f"`{kind.name}`" if kind.requestable else f"({kind.name})"
        wire = kind.wire or ("(by name)" if kind.requestable else "—")
        rows.append(f"| {name} | {wire} | {kind.summary} | {mark[c.trees]} | "
                    f"{mark[c.q]} | {mark[c.own_length]} | {mark[c.shared]} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


class Homes:
    """The long-lived parts of one orchestrator process, one per kind, made on first use."""

    def __init__(self, registry: dict[str, ProposerKind] | None = None) -> None:
        self.kinds = kinds() if registry is None else registry
        self._homes: dict[str, Any] = {}

    def requestable(self) -> list[str]:
        return [name for name, kind in self.kinds.items() if kind.requestable]

    def get(self, name: str, config: Any) -> Any:
        home = self._homes.get(name)
        if home is None:
            home = self._homes[name] = self.kinds[name].make_home(config)
        return home

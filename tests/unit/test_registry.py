"""The proposer registry (orchestrator.proposers.registry): the kinds are written once, every list
derives from it, the wire agrees with it, and installed plugins load by entry point."""
from __future__ import annotations

import ast
import asyncio
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.api.servicer import proposer_kind, served_proposers
from orchestrator.proposers import registry
from orchestrator.proposers.registry import BUILTIN, GROUP, Homes, ProposerKind, kinds, names, table
from specdec.runtime.errors import InvalidArgument
from specdec.v1 import orchestrator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("orchestrator", "client", "gateway", "launcher", "benchmarks", "specdec", "scripts", "distill")


def kind_lists() -> list[str]:
    """Every list, tuple, set or dict in the project's source (tests aside) holding three or more
    built-in kind names as string literals: a list of kinds written out."""
    builtin = {kind.name for kind in BUILTIN}
    found = []
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                    items = node.elts
                elif isinstance(node, ast.Dict):
                    items = [key for key in node.keys if key is not None]
                else:
                    continue
                named = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
                if len(named & builtin) >= 3:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    static = ROOT / "gateway" / "static"
    for path in sorted(static.iterdir()):
        if sum(f'value="{name}"' in path.read_text() for name in builtin) >= 3:
            found.append(str(path.relative_to(ROOT)))
    return found


def test_the_list_of_kinds_is_written_once() -> None:
    assert kind_lists() == [], "derive the list from orchestrator.proposers.registry"
    assert len({kind.name for kind in BUILTIN}) == len(BUILTIN)


def test_the_check_finds_a_list_written_out(tmp_path, monkeypatch) -> None:
    """Control: the scan above does see a list of kinds (so its empty answer means something)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "client").mkdir()
    (tmp_path / "gateway" / "static").mkdir(parents=True)
    (tmp_path / "client" / "api.py").write_text('NAMES = {"draft": 1, "lookup": 2, "none": 4}\n')
    assert kind_lists() == ["client/api.py:1"]


def test_the_wire_enum_and_the_registry_agree() -> None:
    wires = {kind.wire for kind in BUILTIN if kind.wire}
    assert wires == set(pb.Proposer.keys()) - {"PROPOSER_UNSPECIFIED"}
    for kind in BUILTIN:  # the client's derivation of the enum value from a name
        if kind.wire:
            assert kind.wire == f"PROPOSER_{kind.name.upper()}"


class _Config:
    def __init__(self, default: str = "combined", homes: Homes | None = None) -> None:
        self.default_proposer = default
        self.homes = homes or Homes()


@pytest.mark.parametrize(("enum", "name", "want"), [
    (pb.PROPOSER_UNSPECIFIED, "", "combined"), (pb.PROPOSER_LOOKUP, "", "lookup"),
    (pb.PROPOSER_UNSPECIFIED, "suffix", "suffix"), (pb.PROPOSER_DRAFT, "draft", "draft"),
])
def test_a_request_names_its_kind_by_enum_or_by_name(enum, name, want) -> None:
    assert proposer_kind(pb.GenerateRequest(proposer=enum, proposer_name=name), _Config()) == want


@pytest.mark.parametrize(("enum", "name", "message"), [
    (pb.PROPOSER_UNSPECIFIED, "nope", "proposer_name: unknown proposer 'nope'"),
    (pb.PROPOSER_UNSPECIFIED, "prediction", "proposer_name: unknown proposer 'prediction'"),
    (pb.PROPOSER_LOOKUP, "draft", "proposer_name: 'draft' and proposer PROPOSER_LOOKUP name different kinds"),
    (77, "", "proposer: unknown value 77"),
])
def test_an_unknown_or_contradictory_kind_is_invalid_argument(enum, name, message) -> None:
    with pytest.raises(InvalidArgument) as err:
        proposer_kind(pb.GenerateRequest(proposer=enum, proposer_name=name), _Config())
    assert str(err.value).startswith(message)


def test_served_model_lists_requestable_kinds_default_first() -> None:
    assert served_proposers(_Config("suffix")) == ["suffix", *(n for n in names() if n != "suffix")]
    assert "prediction" not in served_proposers(_Config())


def test_flags_and_docs_derive_from_the_registry() -> None:
    from launcher.cli import LAUNCH
    from orchestrator.api.settings import ORCHESTRATOR

    for group in (ORCHESTRATOR, LAUNCH):
        flag = next(f for f in group.flags if f.name == "default-proposer")
        assert list(flag.choices) == names(default_ok=True)
    api = (ROOT / "docs" / "api.md").read_text()
    assert table() in api, "docs/api.md's table of proposers is stale: run `make config-docs`"


PLUGIN = '''
from orchestrator.proposers.base import Proposal, Proposer
from orchestrator.proposers.registry import ProposerKind


class Home:
    def __init__(self, config):
        self.config = config

    async def open(self, opening):
        return Proposer()


KIND = ProposerKind("{name}", "a test plugin", Home)
'''


def install(site: Path, package: str, points: dict[str, str], body: str = "") -> None:
    """A package as pip installs one: its module and a dist-info with `specdec.proposers` entry points."""
    (site / f"{package}.py").write_text(textwrap.dedent(body))
    info = site / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in points.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")


def test_installed_plugins_load_by_entry_point_and_bad_ones_are_skipped(tmp_path, monkeypatch, caplog) -> None:
    install(tmp_path, "good_plugin", {"mine": "good_plugin:KIND"}, PLUGIN.format(name="mine"))
    install(tmp_path, "bad_plugin", {"broken": "bad_plugin:NOPE", "lookup": "lookup_clash:KIND",
                                     "misnamed": "misnamed_plugin:KIND"}, "")
    install(tmp_path, "lookup_clash", {}, PLUGIN.format(name="lookup"))
    install(tmp_path, "misnamed_plugin", {}, PLUGIN.format(name="other"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.ERROR, logger=registry.__name__):
        found = kinds()
    assert found["mine"].summary == "a test plugin" and found["lookup"] is next(k for k in BUILTIN
                                                                              if k.name == "lookup")
    assert "broken" not in found and "misnamed" not in found
    assert "mine" in registry.plugin_names() and "mine" in names()
    logged = caplog.text
    assert "broken" in logged and "taken by a built-in" in logged and "not a ProposerKind named 'misnamed'" in logged
    homes = Homes(found)
    home = homes.get("mine", "the config")
    assert home.config == "the config" and homes.get("mine", None) is home  # one per process
    assert asyncio.run(home.open(None)).proposes


def test_a_kind_names_its_home_by_module_and_attribute() -> None:
    kind = ProposerKind("x", "", "orchestrator.proposers.factory:NoneHome")
    assert type(kind.make_home(None)).__name__ == "NoneHome"


def test_the_loop_reads_a_proposer_only_through_its_declared_interface() -> None:
    """No getattr/hasattr on a proposer in the rooms that drive it: what the loop reads is declared
    on orchestrator.proposers.base.Proposer (with its default)."""
    from orchestrator.proposers.base import Proposer

    found = []
    for room in ("round", "policy", "api"):
        for path in sorted((ROOT / "orchestrator" / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and node.args
                        and "proposer" in ast.unparse(node.args[0])):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "proposer" and not hasattr(Proposer, node.attr)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .proposer.{node.attr}")
    assert found == []

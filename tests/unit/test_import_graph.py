"""The project's import graph: imports point down the layers only, no circles between modules,
serving imports no training, and the orchestrator's entry point starts without torch.

The layers (shared/DESIGN.md): the pure core and the wire contract, then the runtime every
process shares, then the engine (and the client library), the model-service shell, the roles
(target, draft, orchestrator), the gateway, the tools (distill, benchmarks) and the launcher.
A module may import its own package and packages of lower layers, never a package beside it or
above it. Inside the orchestrator its rooms are layered the same way: common (the bottom room:
the request, kinds, grammar, text, events, stats, calls), fleet, policy, proposers, round, api;
the config sits with the proposers (it is built from the rooms below and the proposers' homes).

The graph is read from the source (ast), so it counts every import a module can make: top-level,
inside functions (lazy) and under `if TYPE_CHECKING:` alike. A circle through a lazy import is
still a circle: the two modules cannot be read, tested or moved apart.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "engine", "model_service", "draft_service", "target_service", "orchestrator", "client",
            "gateway", "launcher", "distill", "benchmarks")
# Everything that serves requests; none of it may reach training (distill).
SERVING = ("specdec", "engine", "model_service", "draft_service", "target_service", "orchestrator", "client",
           "gateway", "launcher")
# `specdec distill` hands its arguments to distill.cli, loaded only for that subcommand.
SERVING_EXCEPTIONS = {"launcher.cli"}


LAYERS: tuple[tuple[str, ...], ...] = (
    ("specdec", "specdec.core", "specdec.v1"),  # the pure core, the wire contract
    ("specdec.runtime",),  # server, errors, wire codec, security, store, settings, tracing
    ("engine", "client"),  # the model engine; the client library
    ("model_service",),  # the shell both model services run in
    ("target_service", "draft_service", "orchestrator"),  # the roles
    ("gateway",),  # the OpenAI-compatible HTTP front
    ("distill", "benchmarks"),  # tools
    ("launcher",),  # the `specdec` command (it runs the tools too) and the device check
)
ROOMS = ("orchestrator.common", "orchestrator.fleet", "orchestrator.policy", "orchestrator.proposers",
         "orchestrator.round", "orchestrator.api")
# Root modules of the orchestrator placed in a room for this check: the config is built from the
# fleet, the policies and the proposers' homes, so it sits with the proposers (a room below may not
# reach it, nor through it the rooms above).
PLACED = {"orchestrator.config": "orchestrator.proposers"}


def _room(module: str) -> str | None:
    return PLACED.get(module) or _unit(module, ROOMS)


def _unit(module: str, units: tuple[str, ...]) -> str | None:
    """The longest unit (package prefix) `module` belongs to."""
    found = [u for u in units if module == u or module.startswith(u + ".")]
    return max(found, key=len) if found else None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up or sideways: across the layers, and between the orchestrator's rooms."""
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    packages = tuple(rank)
    bad = []
    for module, targets in graph.items():
        mine = _unit(module, packages)
        for target in targets:
            theirs = _unit(target, packages)
            if mine is None or theirs is None or mine == theirs:
                continue
            if rank[theirs] > rank[mine] or (rank[theirs] == rank[mine] and mine != theirs):
                bad.append(f"{module} -> {target}")
        room = _room(module)
        for target in targets:
            other = _room(target)
            if room and other and ROOMS.index(other) > ROOMS.index(room):
                bad.append(f"{module} -> {target} (room above)")
            if room and target == "orchestrator.__main__":
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to (itself or its nearest enclosing module), if any."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    edges.add(resolved)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "orchestrator.round.steps" in graph and "specdec.core.verify" in graph
    assert "specdec.core.verify" in graph["orchestrator.round.steps"]
    # launcher.cli loads distill.cli inside main() only for `specdec distill`.
    assert "distill.cli" in graph["launcher.cli"]


def test_imports_point_down_the_layers() -> None:
    graph = import_graph()
    assert all(_unit(m, tuple(p for layer in LAYERS for p in layer)) for m in graph), "a module outside the layers"
    bad = layering_violations(graph)
    assert bad == [], "imports up or sideways: " + "; ".join(bad)


def test_the_layering_check_finds_planted_violations() -> None:
    graph = {"specdec.core.verify": {"specdec.runtime.errors"},  # up
             "engine.host": {"client.api"},  # sideways
             "orchestrator.fleet.remote": {"orchestrator.round.loop"},  # a room above
             "orchestrator.common.request": {"orchestrator.fleet.remote"},  # the bottom room reaching up
             "orchestrator.policy.gate": {"orchestrator.config"},  # the config sits with the proposers
             "orchestrator.round.loop": {"orchestrator.fleet.remote", "specdec.core.verify",
                                         "orchestrator.config"},  # fine
             "gateway.app": {"client.api", "orchestrator.common.request"}}  # fine (lower layers)
    assert layering_violations(graph) == [
        "engine.host -> client.api",
        "orchestrator.common.request -> orchestrator.fleet.remote (room above)",
        "orchestrator.fleet.remote -> orchestrator.round.loop (room above)",
        "orchestrator.policy.gate -> orchestrator.config (room above)",
        "specdec.core.verify -> specdec.runtime.errors"]


def test_no_import_cycles_between_project_modules() -> None:
    found = cycles(import_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def _reachable(graph: dict[str, set[str]], start: str, skip: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w not in seen and w not in skip:
                seen.add(w)
                todo.append(w)
    return seen


def test_serving_imports_no_training() -> None:
    graph = import_graph()
    serving = [m for m in graph if m.split(".")[0] in SERVING and m not in SERVING_EXCEPTIONS]
    bad = {m: sorted(d for d in _reachable(graph, m, SERVING_EXCEPTIONS) if d.split(".")[0] == "distill")
           for m in serving}
    assert {m: d for m, d in bad.items() if d} == {}


def _imported_after(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_orchestrator_entry_point_does_not_import_torch_or_model_hosting() -> None:
    loaded = _imported_after("import orchestrator.__main__")
    assert "orchestrator.__main__" in loaded  # the check can see what it is looking for
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "engine", "distill")
             or m.startswith("model_service")]
    assert heavy == []

"""The project's import graph: no circles between modules, serving imports no training, and the
orchestrator's entry point starts without torch.

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
    assert "orchestrator.round.loop" in graph and "specdec.core.verify" in graph
    assert "specdec.core.verify" in graph["orchestrator.round.loop"]
    # launcher.cli loads distill.cli inside main() only for `specdec distill`.
    assert "distill.cli" in graph["launcher.cli"]


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

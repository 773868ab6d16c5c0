"""The shape of the code: folders, functions and docstrings stay small enough to read.

Measured on the source tree (not tests, not generated code): no folder of code holds more than
15 modules, no function is longer than 100 lines (the round function of the orchestrator no
longer than 60), no module docstring is longer than 40 lines, and the README stays under 250
lines. Each check is shown to catch a planted offender.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ["specdec", "engine", "model_service", "draft_service", "target_service", "orchestrator", "client",
        "gateway", "launcher", "benchmarks", "distill", "scripts"]
MAX_MODULES, MAX_FUNCTION, MAX_DOCSTRING, MAX_README = 15, 100, 40, 250


def modules() -> list[Path]:
    return [p for top in CODE for p in (ROOT / top).rglob("*.py")
            if "_pb2" not in p.name and "static" not in p.parts]


def crowded_folders(paths: list[Path]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in paths:
        counts[str(p.parent.relative_to(ROOT))] = counts.get(str(p.parent.relative_to(ROOT)), 0) + 1
    return {folder: n for folder, n in counts.items() if n > MAX_MODULES}


def long_functions(source: str, limit: int = MAX_FUNCTION) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                out.append((node.name, length))
    return out


def docstring_lines(source: str) -> int:
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return len(doc.splitlines()) if doc else 0


def test_no_folder_of_code_holds_more_than_15_modules() -> None:
    assert crowded_folders(modules()) == {}
    planted = [ROOT / "gateway" / f"m{i}.py" for i in range(16)]
    assert crowded_folders(planted) == {"gateway": 16}


def test_no_function_longer_than_100_lines_and_the_round_function_under_60() -> None:
    offenders = {str(p.relative_to(ROOT)): long_functions(p.read_text()) for p in modules()}
    assert {path: found for path, found in offenders.items() if found} == {}
    loop = (ROOT / "orchestrator" / "round" / "loop.py").read_text()
    assert long_functions(loop, 60) == []
    planted = "def f():\n" + "    x = 1\n" * MAX_FUNCTION
    assert long_functions(planted) == [("f", MAX_FUNCTION + 1)]


def test_no_module_docstring_longer_than_40_lines_and_a_short_readme() -> None:
    long_docs = {str(p.relative_to(ROOT)): n for p in modules() if (n := docstring_lines(p.read_text())) > MAX_DOCSTRING}
    assert long_docs == {}
    assert docstring_lines('"""' + "line\n" * 41 + '"""\n') == 41 > MAX_DOCSTRING
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README

"""Regenerate docs/configuration.md from the settings definitions (specdec.runtime.settings and each
process's own), and docs/api.md's table of proposer kinds from orchestrator.proposers.registry.
tests/unit/test_settings.py fails when a page differs from a fresh rendering.

    python scripts/gen_config_docs.py          # write the page
    python scripts/gen_config_docs.py --check  # exit 1 if it is stale
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
API = ROOT / "docs" / "api.md"  # its table of proposer kinds (orchestrator.proposers.registry)


def processes() -> list[tuple[str, str, object]]:
    """(title, command, Settings) of every specdec process, in the page's order."""
    sys.path.insert(0, str(ROOT))
    import distill.cli
    import gateway.__main__ as gateway_main
    import orchestrator.__main__ as orchestrator_main
    from draft_service.role import ROLE as DRAFT
    from gateway.settings import gateway_settings
    from orchestrator.api.settings import orchestrator_settings
    from launcher import cli
    from model_service.settings import service_settings
    from target_service.role import ROLE as TARGET

    return [
        ("Target service", "python -m target_service", service_settings(TARGET)),
        ("Draft service", "python -m draft_service", service_settings(DRAFT)),
        ("Orchestrator", "python -m orchestrator", orchestrator_settings(orchestrator_main.__doc__)),
        ("Gateway", "python -m gateway", gateway_settings(gateway_main.__doc__)),
        *[(f"Launcher: specdec {name}", f"specdec {name}", settings) for name, settings, _ in cli.COMMANDS],
        ("Distill", "specdec distill (python -m distill)", distill.cli.SETTINGS),
    ]


def render() -> str:
    from specdec.runtime.settings import reference

    return reference(processes())


def with_proposers(text: str) -> str:
    """docs/api.md with its table of proposer kinds rendered from the registry."""
    from orchestrator.proposers.registry import TABLE_END, TABLE_START, table

    if TABLE_START in text:
        head, rest = text.split(TABLE_START, 1)
        return head + table() + rest.split(TABLE_END, 1)[1]
    return text.replace("\nTABLE\n", f"\n{table()}\n", 1)


def main(argv: list[str]) -> int:
    pages = {PAGE: render(), API: with_proposers(API.read_text())}
    if argv[:1] == ["--check"]:
        stale = [page for page, text in pages.items() if page.read_text() != text]
        for page in stale:
            print(f"{page.relative_to(ROOT)} is stale: run `make config-docs`", file=sys.stderr)
        return 1 if stale else 0
    for page, text in pages.items():
        page.write_text(text)
        print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

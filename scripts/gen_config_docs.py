"""Regenerate docs/configuration.md from the settings definitions (specdec.runtime.settings and each
process's own). tests/unit/test_settings.py fails when the page differs from a fresh rendering.

    python scripts/gen_config_docs.py          # write the page
    python scripts/gen_config_docs.py --check  # exit 1 if it is stale
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


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


def main(argv: list[str]) -> int:
    text = render()
    if argv[:1] == ["--check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `make config-docs`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

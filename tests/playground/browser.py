"""Debian's Chromium, headless, driven by playwright; and the playground page's steps as actions.

Never lets playwright fetch a browser: it runs /usr/bin/chromium (apt-get install chromium)
through `executable_path`, with the flags a machine without outside network needs (no
background connections) and a fresh --user-data-dir each launch. Used by the browser tests
and by scripts/playground_screenshots.py.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def missing() -> str | None:
    """Why the browser cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[test]')"
    return None


@contextlib.contextmanager
def browser(viewport: dict | None = None) -> Iterator[object]:
    """A persistent Chromium context on a fresh profile folder, closed and removed afterwards."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="specdec-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=str(CHROMIUM), headless=True, args=FLAGS,
                viewport=viewport or {"width": 1100, "height": 900})
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def only_origin(context, base: str) -> list[str]:
    """Refuse every request that does not go to `base`'s origin (the network cut off but for
    the gateway); returns the list the refused URLs are appended to."""
    origin = urlsplit(base)[:2]
    refused: list[str] = []

    def route(r) -> None:
        url = r.request.url
        if urlsplit(url)[:2] == origin or url.startswith(("data:", "blob:")):
            r.continue_()
        else:
            refused.append(url)
            r.abort()

    context.route("**/*", route)
    return refused


def submit(page, form: str, timeout_ms: float = 120_000) -> None:
    """Press the form's button and wait until the step has finished (its form is no longer busy)."""
    page.click(f"{form} button[type=submit]")
    page.wait_for_selector(f'{form}[aria-busy="false"]', timeout=timeout_ms)


def fill(page, values: dict[str, str]) -> None:
    for selector, value in values.items():
        page.fill(selector, str(value))


def counters(page, box: str) -> dict[str, tuple[int, int]]:
    """{'this': (passes, tokens), 'twin': (passes, tokens)} of one counters block."""
    out = {}
    for which in ("this", "twin"):
        cells = [page.inner_text(f"{box} .counter.{which} [data-counter={k}]") for k in ("passes", "tokens")]
        out[which] = (int(cells[0]), int(cells[1]))
    return out


def remaining(page) -> int:
    return int(page.get_attribute("#quota", "data-remaining"))

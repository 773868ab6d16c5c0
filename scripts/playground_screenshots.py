"""Screenshots of every playground step on the embedded models, for docs/playground/ and docs/api.md.

    python scripts/playground_screenshots.py [--out docs/playground]

Starts `specdec up` (embedded SmolLM2-135M-Instruct target, shipped distilled draft; no
gateway of its own), puts `python -m gateway` with a pass quota of 200 per minute in front of
its orchestrator (the default 30 would not cover all five steps in one minute), runs each step
in headless Chromium with the page's own default inputs and saves one picture per step, then
stops everything. Needs /usr/bin/chromium and the playwright package (the test extra).
"""
from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.runtime import procs  # noqa: E402
from tests.playground import browser as chromium  # noqa: E402

QUOTA = 200


def _wait_for(log: Path, pattern: str, proc, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, log.read_text(), re.M)
        if found:
            return found
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"not ready:\n{log.read_text()}")
        time.sleep(0.3)


def shoot(base: str, out: Path) -> None:
    with chromium.browser(viewport={"width": 1100, "height": 900}) as context:
        refused = chromium.only_origin(context, base)
        page = context.new_page()
        page.goto(f"{base}/playground")
        page.wait_for_selector("#quota[data-remaining]")
        steps = [("step1", "#step1 form"), ("step2", "#step2 form"), ("step3", "#step3 form"),
                 ("step4", "#step4 form"), ("step5", "#step5 form"), ("step5", "#sample-form")]
        for name, form in steps:
            chromium.submit(page, form, timeout_ms=600_000)
            status = page.inner_text(f"#{name} .status")
            if "rror" in status or "quota" in status.lower():
                raise RuntimeError(f"{name}: {status}")
        page.wait_for_timeout(400)
        for name in ("step1", "step2", "step3", "step4", "step5"):
            page.locator(f"#{name}").screenshot(path=str(out / f"{name}.png"))
            print(f"wrote {out / f'{name}.png'}")
        page.check("input[name=sampler][value=wrong]")
        chromium.submit(page, "#sample-form")
        page.locator("#step5").screenshot(path=str(out / "step5-control.png"))
        print(f"wrote {out / 'step5-control.png'}")
        for sel in ("#step3-equality", "#step4-equality", "#step5-measured", "#sample-verdict"):
            print(f"{sel}: {page.inner_text(sel)}")
        if refused:
            raise RuntimeError(f"the page tried to reach other origins: {refused}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "playground"))
    args = parser.parse_args()
    if reason := chromium.missing():
        print(reason, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="specdec-screens-"))
    up_log = logs / "up.out"
    up = procs.start(["python", "-m", "launcher.cli", "up", "--port", str(procs.free_port()),
                      "--gateway-port", "0", "--logs", str(logs)], log_path=up_log)
    gateway = None
    try:
        orch = _wait_for(up_log, r"^orchestrator\s+(\S+)$", up, 600).group(1)
        _wait_for(up_log, r"^ready:", up, 600)
        port = procs.free_port()
        gateway = procs.start(["python", "-m", "gateway", "--orchestrator", orch, "--port", str(port),
                               "--playground-passes-per-minute", str(QUOTA)],
                              log_path=logs / "gateway.out")
        _wait_for(logs / "gateway.out", r"Uvicorn running", gateway, 60)
        shoot(f"http://127.0.0.1:{port}", out)
    finally:
        if gateway is not None:
            procs.stop(gateway)
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        finally:
            procs.stop(up)
    return 0


if __name__ == "__main__":
    sys.exit(main())

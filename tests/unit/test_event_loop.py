"""specdec.runtime.loop: --event-loop picks the loop a process runs on."""
from __future__ import annotations

import asyncio
import sys

import pytest

from specdec.runtime import loop


async def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_auto_and_uvloop_run_on_uvloop_where_it_is_installed():
    pytest.importorskip("uvloop")
    assert loop.run(_loop_kind(), "auto") == "uvloop"
    assert loop.run(_loop_kind(), "uvloop") == "uvloop"


def test_asyncio_runs_on_the_standard_loop():
    assert loop.run(_loop_kind(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_refuses(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop.run(_loop_kind(), "auto") == "asyncio"
    coro = _loop_kind()
    with pytest.raises(SystemExit, match="uvloop is not installed"):
        loop.run(coro, "uvloop")
    coro.close()


def test_an_unknown_loop_is_refused():
    coro = _loop_kind()
    with pytest.raises(ValueError, match="--event-loop"):
        loop.run(coro, "trio")
    coro.close()

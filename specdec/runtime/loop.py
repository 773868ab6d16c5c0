"""Which asyncio event loop a specdec process runs on (--event-loop).

`uvloop` is a drop-in asyncio loop written in C over libuv: scheduling a callback, a timer, a
future's wake-up and a socket write each cost less than on the standard library's loop, and at
millisecond rounds an orchestrator schedules several per stream per round. `auto` (the default)
takes it where it is installed (it is a dependency on Linux and macOS), else the standard loop;
`asyncio` asks for the standard loop; `uvloop` where it is missing refuses to start.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """asyncio.run(main) on the loop `loop` names (see the module docstring)."""
    if loop not in LOOPS:
        raise ValueError(f"--event-loop: {loop!r} is not one of {', '.join(LOOPS)}")
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise SystemExit("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            log.debug("event loop: uvloop %s", uvloop.__version__)
            return uvloop.run(main)
    return asyncio.run(main)

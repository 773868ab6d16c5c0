"""Real processes for integration tests: target, draft and orchestrator on free ports."""
from __future__ import annotations

import asyncio
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from specdec import procs
from specdec.store import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}


@dataclass
class Stack:
    """Processes started for a test, stopped by pid in `stop()`."""

    logs: Path
    prefix: str = field(default_factory=lambda: f"specdec-test-{uuid.uuid4().hex[:12]}:")
    redis_url: str = REDIS_URL
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def start_service(self, name: str, role: str, model: Path, *, register: bool = True,
                      extra: tuple[str, ...] = (), port: int | None = None) -> str:
        port = port or procs.free_port()
        argv = ["python", "-m", f"{role}_service", "--model", str(model), "--port", str(port),
                "--threads", "1", "--replica-id", name, *extra]
        if register:
            argv += ["--redis-url", self.redis_url, "--redis-prefix", self.prefix]
        return self._start(name, argv, port)

    def start_orchestrator(self, name: str, tokenizer: Path, *, targets=(), drafts=(),
                           redis_url: str | None = None, extra: tuple[str, ...] = (),
                           wait: bool = True) -> str:
        port = procs.free_port()
        argv = ["python", "-m", "orchestrator", "--port", str(port), "--tokenizer", str(tokenizer),
                "--redis-url", redis_url or self.redis_url, "--redis-prefix", self.prefix,
                "--startup-timeout", "20", *extra]
        for t in targets:
            argv += ["--target", t]
        for d in drafts:
            argv += ["--draft", d]
        return self._start(name, argv, port, wait=wait)

    def _start(self, name: str, argv: list[str], port: int, wait: bool = True) -> str:
        address = f"127.0.0.1:{port}"
        proc = procs.start(argv, env=ENV, log_path=self.logs / f"{name}.log")
        self.procs[name], self.addresses[name] = proc, address
        if wait:
            procs.wait_healthy(address, proc, timeout=120)
        return address

    def stop_one(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            procs.stop(proc)

    def stop(self) -> None:
        for name in list(self.procs):
            self.stop_one(name)
        asyncio.run(delete_prefix(self.redis_url, self.prefix))


"""Real processes for integration tests: target, draft and orchestrator on free ports."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from specdec.runtime import procs
from specdec.runtime.launch import Processes, child_env, device_under_test, orchestrator_argv, service_argv
from specdec.runtime.store import delete_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"
ENV = child_env(1, quiet=True)


@dataclass
class Stack:
    """Processes started for a test, stopped by pid in `stop()`."""

    logs: Path
    prefix: str = field(default_factory=lambda: f"specdec-test-{uuid.uuid4().hex[:12]}:")
    redis_url: str = REDIS_URL
    addresses: dict[str, str] = field(default_factory=dict)
    processes: Processes = field(init=False)

    def __post_init__(self) -> None:
        self.processes = Processes(self.logs, env=ENV)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """Running processes by name."""
        return self.processes.running

    def start_service(self, name: str, role: str, model: Path | None, *, register: bool = True,
                      extra: tuple[str, ...] = (), port: int | None = None, wait: bool = True) -> str:
        """Start a model service (model None: the role's default); with wait=False, call
        `wait_serving` later (services started together load their models in parallel)."""
        port = port or procs.free_port()
        registry = dict(redis_url=self.redis_url, redis_prefix=self.prefix) if register else {}
        argv = service_argv(role, port, model=model, threads=1, replica_id=name, extra=extra,
                            device=device_under_test(), **registry)
        return self._serve(name, argv, port, wait=wait)

    def wait_serving(self, *names: str) -> None:
        for name in names:
            procs.wait_healthy(self.addresses[name], self.procs[name], timeout=120)

    def start_orchestrator(self, name: str, tokenizer: Path, *, targets=(), drafts=(),
                           redis_url: str | None = None, extra: tuple[str, ...] = (),
                           wait: bool = True, env: dict[str, str] | None = None) -> str:
        port = procs.free_port()
        argv = orchestrator_argv(port, tokenizer=tokenizer, targets=targets, drafts=drafts,
                                 redis_url=redis_url or self.redis_url, redis_prefix=self.prefix,
                                 extra=("--startup-timeout", "20", *extra))
        return self._serve(name, argv, port, wait=wait, env=env)

    def start_gateway(self, orchestrator: str = "orch", extra: tuple[str, ...] = ()) -> str:
        """`python -m gateway` in front of the named orchestrator (several: names joined by commas);
        returns its base URL."""
        port = procs.free_port()
        addresses = ",".join(self.addresses[name] for name in orchestrator.split(","))
        proc = procs.start(["python", "-m", "gateway", "--orchestrator", addresses,
                            "--port", str(port), *extra],
                           env=ENV, log_path=self.logs / "gateway.log")
        self.procs["gateway"] = proc  # stopped by pid with the rest
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/v1/models", proc)
        return base

    def _serve(self, name: str, argv: list[str], port: int, wait: bool = True,
               env: dict[str, str] | None = None) -> str:
        self.addresses[name] = self.processes.serve(name, argv, port, timeout=120, wait=wait, env=env)
        return self.addresses[name]

    def stop_one(self, name: str) -> None:
        self.processes.stop(name)

    def stop(self) -> None:
        self.processes.stop_all()
        asyncio.run(delete_prefix(self.redis_url, self.prefix))


def wait_http(url: str, proc, timeout: float = 60.0) -> None:
    """Until `url` answers (a gateway started as `proc`); its log if it dies or never does."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise procs.ServiceDied(f"gateway exited with {proc.returncode}:\n{procs.log_tail(proc)}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:  # it answers (a 401 where tokens are required)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} answers {exc.code}; log:\n{procs.log_tail(proc)}") from None
            time.sleep(0.2)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not answering; log:\n{procs.log_tail(proc)}") from None
            time.sleep(0.2)


def post_json(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    """(HTTP status, JSON reply) of a JSON POST, error statuses included."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete_concurrently(address: str, prompts: list[str], *, return_exceptions: bool = False, **options):
    """Every prompt's completion at once from one async client (options as Client.complete takes them)."""
    from client import AsyncClient

    async def run():
        async with AsyncClient(address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(p, **options) for p in prompts),
                                        return_exceptions=return_exceptions)

    return asyncio.run(run())

"""Start and stop the benchmark's own stack: target, draft, orchestrator(s), link emulators.

Every process is started by specdec.procs and stopped by its own pid. The
services run without Redis registration and the orchestrators use a private
Redis key prefix, so nothing here routes to (or is routed to from) another
stack sharing the same Redis; our keys are deleted at the end.
"""
from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.linkemu import LinkEmulator
from specdec import procs


@dataclass(frozen=True)
class StackSpec:
    target: str | None          # --model for the target; None = embedded default
    draft: str | None           # --model for the draft; None = the draft service's default
    draft_layers: int | None    # early-exit layers of the target instead (when draft is None)
    device: str = "cpu"
    dtype: str = "float32"
    draft_dtype: str | None = None  # None = the draft's own choice
    threads: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"
    log_dir: Path = Path("/tmp")
    # k for requests that send k = 0: "auto" picks it each round (svc-draft-auto); every
    # other configuration sends its own k, so this touches nothing else.
    default_k: str = "auto"


@dataclass
class Stack:
    spec: StackSpec
    prefix: str = field(default_factory=lambda: f"specdec-bench-{uuid.uuid4().hex[:8]}:")
    target_address: str = ""
    draft_address: str = ""
    orchestrator_address: str = ""
    linked_address: str = ""    # an orchestrator reaching the services through the emulators
    links: list[LinkEmulator] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list)

    # ------------------------------------------------------------------ start
    def _env(self) -> dict[str, str]:
        n = str(self.spec.threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "SPECDEC_THREADS": n,
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error",
                "SPECDEC_REDIS_URL": ""}  # services: no registry entry another stack could route to

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.spec.log_dir / f"{name}.log"
        proc = procs.start(argv, env=self._env(), log_path=log)
        self._procs.append(proc)
        return proc

    def _model_args(self, model: str | None, layers: int | None, dtype: str | None) -> list[str]:
        args = ["--device", self.spec.device, "--threads", str(self.spec.threads)]
        if dtype:
            args += ["--dtype", dtype]
        if model:
            args += ["--model", model]
        if layers:
            args += ["--num-layers", str(layers)]
        return args

    def _draft_args(self) -> list[str]:
        """--draft folder; else an early exit of the target; else the service's own default."""
        s = self.spec
        if s.draft:
            return self._model_args(s.draft, None, s.draft_dtype)
        if s.draft_layers:
            return self._model_args(s.target, s.draft_layers, s.draft_dtype)
        return self._model_args(None, None, s.draft_dtype)

    def start_services(self, timeout: float = 300.0) -> None:
        s = self.spec
        tport, dport = procs.free_port(), procs.free_port()
        self.target_address = f"127.0.0.1:{tport}"
        self.draft_address = f"127.0.0.1:{dport}"
        target = self._start("target", ["python", "-m", "target_service", "--port", str(tport),
                                        *self._model_args(s.target, None, s.dtype)])
        draft = self._start("draft", ["python", "-m", "draft_service", "--port", str(dport),
                                      *self._draft_args()])
        procs.wait_healthy(self.target_address, target, timeout=timeout)
        procs.wait_healthy(self.draft_address, draft, timeout=timeout)

    def start_orchestrator(self, target: str, draft: str, name: str, timeout: float = 120.0) -> str:
        port = procs.free_port()
        proc = self._start(name, [
            "python", "-m", "orchestrator", "--port", str(port),
            "--target", target, "--draft", draft,
            "--redis-url", self.spec.redis_url, "--redis-prefix", self.prefix,
            "--default-k", self.spec.default_k, "--threads", "1",
            *(["--tokenizer", self.spec.target] if self.spec.target else []),
        ])
        address = f"127.0.0.1:{port}"
        procs.wait_healthy(address, proc, timeout=timeout)
        return address

    def start(self, *, with_link: bool) -> None:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_services()
        self.orchestrator_address = self.start_orchestrator(
            self.target_address, self.draft_address, "orchestrator")
        if with_link:
            self.links = [LinkEmulator(self.target_address, procs.free_port()),
                          LinkEmulator(self.draft_address, procs.free_port())]
            self.linked_address = self.start_orchestrator(
                self.links[0].address, self.links[1].address, "orchestrator-linked")

    # ------------------------------------------------------------------- stop
    def stop(self) -> None:
        for link in self.links:
            link.stop()
        for proc in reversed(self._procs):
            procs.stop(proc)
        self._procs.clear()
        self._delete_keys()

    def _delete_keys(self) -> None:
        try:
            import redis

            client = redis.Redis.from_url(self.spec.redis_url, socket_timeout=2)
            keys = list(client.scan_iter(match=f"{self.prefix}*", count=500))
            if keys:
                client.delete(*keys)
        except Exception:  # noqa: BLE001 - cleanup is best effort; keys carry a TTL anyway
            pass

    def logs(self) -> list[Path]:
        return sorted(self.spec.log_dir.glob("*.log"))

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


"""Start and stop the benchmark's own stack: target, draft, orchestrator(s), link emulators.

Command lines come from specdec.runtime.launch; every process is stopped by its own pid. The
services run without Redis registration and the orchestrators use a private
Redis key prefix, so nothing here routes to (or is routed to from) another
stack sharing the same Redis; our keys are deleted at the end.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.linkemu import LinkEmulator
from specdec.runtime import procs
from specdec.runtime.launch import Processes, child_env, orchestrator_argv, service_argv


# --suffix-cache-tokens for a benchmark's orchestrators (StackSpec.suffix_cache_tokens).
SUFFIX_CACHE_OFF = 0


def suffix_cache_flags(tokens: int | None) -> tuple[str, ...]:
    return () if tokens is None else ("--suffix-cache-tokens", str(tokens))


@dataclass(frozen=True)
class StackSpec:
    target: str | None          # --model for the target; None = embedded default
    draft: str | None           # --model for the draft; None = the draft service's default
    draft_layers: int | None    # early-exit layers of the target instead (when draft is None)
    device: str = "cpu"
    dtype: str = "float32"
    draft_dtype: str | None = None  # None = the draft's own choice
    target_extra: tuple[str, ...] = ()  # more flags for the target service (e.g. --no-batch-invariant)
    threads: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"
    log_dir: Path = Path("/tmp")
    # k for requests that send k = 0: "auto" picks it each round (svc-draft-auto); every
    # other configuration sends its own k, so this touches nothing else.
    default_k: str = "auto"
    # --trace-dir: every process appends its spans to DIR/<name>.jsonl (specdec.runtime.tracing).
    trace_dir: Path | None = None
    # The orchestrators' --suffix-cache-tokens. A benchmark replays the same prompts across its
    # configurations and repetitions, so by default suffix decoding learns nothing across requests
    # (0: it matches each request's own tokens only) and no configuration reads another's answer
    # to the same prompt; None: the orchestrator's own default (benchmarks.features.suffix).
    suffix_cache_tokens: int | None = SUFFIX_CACHE_OFF


@dataclass
class Stack:
    spec: StackSpec
    prefix: str = field(default_factory=lambda: f"specdec-bench-{uuid.uuid4().hex[:8]}:")
    target_address: str = ""
    draft_address: str = ""
    orchestrator_address: str = ""
    linked_address: str = ""    # an orchestrator reaching the services through the emulators
    links: list[LinkEmulator] = field(default_factory=list)
    _processes: Processes | None = None

    # ------------------------------------------------------------------ start
    def _group(self) -> Processes:
        if self._processes is None:
            # SPECDEC_REDIS_URL="": services get no registry entry another stack could route to.
            env = child_env(self.spec.threads, quiet=True, SPECDEC_THREADS=str(self.spec.threads),
                            SPECDEC_REDIS_URL="")
            self._processes = Processes(self.spec.log_dir, env=env)
        return self._processes

    def _trace_file(self, name: str) -> Path | None:
        return self.spec.trace_dir / f"{name}.jsonl" if self.spec.trace_dir else None

    def _service_argv(self, role: str, port: int, model: str | None, layers: int | None,
                      dtype: str | None) -> list[str]:
        return service_argv(role, port, model=model, num_layers=layers, dtype=dtype,
                            device=self.spec.device, threads=self.spec.threads,
                            trace_file=self._trace_file(role))

    def _draft_argv(self, port: int) -> list[str]:
        """--draft folder; else an early exit of the target; else the service's own default."""
        s = self.spec
        if s.draft:
            return self._service_argv("draft", port, s.draft, None, s.draft_dtype)
        if s.draft_layers:
            return self._service_argv("draft", port, s.target, s.draft_layers, s.draft_dtype)
        return self._service_argv("draft", port, None, None, s.draft_dtype)

    def start_services(self, timeout: float = 300.0) -> None:
        s = self.spec
        tport, dport = procs.free_port(), procs.free_port()
        group = self._group()
        target = group.start("target", self._service_argv("target", tport, s.target, None, s.dtype)
                             + list(s.target_extra))
        draft = group.start("draft", self._draft_argv(dport))
        self.target_address = f"127.0.0.1:{tport}"
        self.draft_address = f"127.0.0.1:{dport}"
        procs.wait_healthy(self.target_address, target, timeout=timeout)
        procs.wait_healthy(self.draft_address, draft, timeout=timeout)

    def start_orchestrator(self, target: str, draft: str, name: str, timeout: float = 120.0,
                           extra: tuple[str, ...] = ()) -> str:
        port = procs.free_port()
        argv = orchestrator_argv(port, tokenizer=self.spec.target, targets=[target], drafts=[draft],
                                 redis_url=self.spec.redis_url, redis_prefix=self.prefix,
                                 default_k=self.spec.default_k, threads=1,
                                 trace_file=self._trace_file(name),
                                 extra=(*suffix_cache_flags(self.spec.suffix_cache_tokens), *extra))
        return self._group().serve(name, argv, port, timeout=timeout)

    def start(self, *, with_link: bool, orchestrator_extra: tuple[str, ...] = ()) -> None:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_services()
        self.orchestrator_address = self.start_orchestrator(
            self.target_address, self.draft_address, "orchestrator", extra=orchestrator_extra)
        if with_link:
            self.links = [LinkEmulator(self.target_address, procs.free_port()),
                          LinkEmulator(self.draft_address, procs.free_port())]
            self.linked_address = self.start_orchestrator(
                self.links[0].address, self.links[1].address, "orchestrator-linked")

    # ------------------------------------------------------------------- stop
    def stop(self) -> None:
        for link in self.links:
            link.stop()
        if self._processes is not None:
            self._processes.stop_all()
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


def prepare_run(args, prefix: str) -> Path:
    """What every benchmark's main() does first: quiet, offline libraries; the torch
    threads asked for; the output folder; a scratch folder (returned); with --tiny,
    the tiny test models built there and used as target and draft."""
    import os
    import tempfile

    for name, value in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"),
                        ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(name, value)
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    if args.tiny:
        from tests.tiny import build_pair

        target_dir, draft_dir = build_pair(workdir / "tiny", vocab=getattr(args, "tiny_vocab", 0) or 0)
        if getattr(args, "tiny_head", False):
            from tests.tiny import build_feature_head

            draft_dir = build_feature_head(target_dir, workdir / "tiny" / "head")
        args.target, args.draft = str(target_dir), str(draft_dir)
    return workdir

"""Every specdec process's command line, built in one place.

`specdec up`/`demo`, the integration and service tests and the benchmarks all
start the target, draft and orchestrator through `service_argv`,
`orchestrator_argv` and `child_env`, and keep them in a `Processes` group
that stops each one by its own pid (specdec.runtime.procs), newest first.
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specdec.runtime import procs

LOCALHOST = "127.0.0.1"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's limit), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadSplit:
    """Torch threads per process when target, draft and orchestrator share one machine."""

    target: int
    draft: int
    orchestrator: int = 1

    def describe(self, cores: int) -> str:
        return (f"{cores} cores: target {self.target} threads, draft {self.draft}, "
                f"orchestrator {self.orchestrator}")


def split_threads(cores: int | None = None) -> ThreadSplit:
    """Share `cores` between the two model services instead of giving each all of them.

    The target gets ceil(cores / 2) threads and the draft the rest (at least 1
    each); the orchestrator, which mostly waits on RPCs and verifies on small
    tensors, gets 1. With every service at all cores, the target's and the
    draft's thread pools (and their spin-waiting OpenMP workers) oversubscribe
    the machine and each forward gets slower than it is alone; on 2 cores the
    split is 1 + 1, which is also what the benchmarks measure with. In
    parallel speculation both services compute at once, so they must not
    share cores. The draft needs fewer threads than the target (it is several
    times smaller), but a round waits for both, so the split stays even.
    """
    cores = cores or available_cores()
    target = max(1, -(-cores // 2))
    return ThreadSplit(target=target, draft=max(1, cores - target))


def device_under_test() -> str | None:
    """SPECDEC_TEST_DEVICE (e.g. cuda:0): the device the service and integration tests'
    model services run on; unset = each service's default (cpu)."""
    return os.environ.get("SPECDEC_TEST_DEVICE") or None


def child_env(threads: int | None = None, *, quiet: bool = False, **more: str) -> dict[str, str]:
    """Environment added for a child process.

    `threads` also caps the BLAS/OpenMP pools (torch's own count is --threads),
    so processes sharing a small CPU do not oversubscribe it.
    """
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if quiet:
        env["TRANSFORMERS_VERBOSITY"] = "error"
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return env | more


def _flags(**values: object) -> list[str]:
    """--name value for every value that is set (None and "" are left to the process's default)."""
    argv: list[str] = []
    for name, value in values.items():
        if value is not None and value != "":
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def service_argv(
    role: str,
    port: int,
    *,
    model: str | Path | None = None,
    revision: str | None = None,
    max_model_len: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    num_layers: int | None = None,
    threads: int | None = None,
    replica_id: str | None = None,
    redis_url: str | None = None,
    redis_prefix: str | None = None,
    metrics_port: int | None = None,
    trace_file: str | Path | None = None,
    extra: Iterable[str] = (),
) -> list[str]:
    """`python -m {role}_service ...`; unset options keep the service's defaults."""
    return ["python", "-m", f"{role}_service", "--port", str(port), *_flags(
        model=model, revision=revision, max_model_len=max_model_len, device=device, dtype=dtype,
        num_layers=num_layers, threads=threads,
        replica_id=replica_id, redis_url=redis_url, redis_prefix=redis_prefix,
        metrics_port=metrics_port, trace_file=trace_file,
    ), *extra]


def orchestrator_argv(
    port: int,
    *,
    tokenizer: str | Path | None = None,
    tokenizer_revision: str | None = None,
    chat_template: str | Path | None = None,
    targets: Iterable[str] = (),
    drafts: Iterable[str] = (),
    redis_url: str | None = None,
    redis_prefix: str | None = None,
    threads: int | None = None,
    default_proposer: str | None = None,
    default_k: str | None = None,
    metrics_port: int | None = None,
    trace_file: str | Path | None = None,
    extra: Iterable[str] = (),
) -> list[str]:
    """`python -m orchestrator ...`; with no targets/drafts it discovers them in Redis."""
    argv = ["python", "-m", "orchestrator", "--port", str(port), *_flags(
        tokenizer=tokenizer, tokenizer_revision=tokenizer_revision, chat_template=chat_template,
        redis_url=redis_url, redis_prefix=redis_prefix, threads=threads,
        default_proposer=default_proposer, default_k=default_k, metrics_port=metrics_port,
        trace_file=trace_file,
    )]
    for address in targets:
        argv += ["--target", address]
    for address in drafts:
        argv += ["--draft", address]
    return argv + list(extra)


@dataclass
class Processes:
    """Named child processes with logs under `logs`, each stopped by its own pid."""

    logs: Path
    env: Mapping[str, str] = field(default_factory=child_env)
    running: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], *, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` as `name` (log: logs/name.log); `env` adds to the group's environment."""
        proc = procs.start(argv, env={**self.env, **(env or {})}, log_path=self.logs / f"{name}.log")
        self.running[name] = proc
        return proc

    def serve(self, name: str, argv: list[str], port: int, *, timeout: float = 120.0,
              wait: bool = True, env: Mapping[str, str] | None = None) -> str:
        """Start a gRPC server listening on `port`; with `wait`, return once it is SERVING."""
        address = f"{LOCALHOST}:{port}"
        proc = self.start(name, argv, env=env)
        if wait:
            procs.wait_healthy(address, proc, timeout=timeout)
        return address

    def stop(self, name: str) -> int | None:
        proc = self.running.pop(name, None)
        return procs.stop(proc) if proc is not None else None

    def stop_all(self) -> None:
        """Newest first, so the orchestrator goes before the services it calls."""
        for name in reversed(list(self.running)):
            self.stop(name)

    def exited(self) -> tuple[str, int] | None:
        """(name, exit code) of a process that has exited, if any."""
        for name, proc in self.running.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

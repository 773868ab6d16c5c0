"""Real service processes on free ports, stopped by pid in teardown."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from specdec.runtime import procs
from specdec.core.fingerprint import fingerprint
from specdec.runtime.launch import child_env, device_under_test, service_argv
from specdec.v1 import common_pb2, model_pb2, model_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    role: str
    proc: object
    port: int
    metrics_port: int
    channel: grpc.Channel
    stub: object  # TargetServiceStub or DraftServiceStub
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        self.channel.close()
        return procs.stop(self.proc)


def launch(
    role: str, model: Path | None, tmp: Path, *extra: str, port: int | None = None,
    timeout: float = 120, env: dict[str, str] | None = None,
) -> Service:
    """Start `python -m {role}_service` with one thread (on SPECDEC_TEST_DEVICE if set) and wait for SERVING."""
    port = port or procs.free_port()
    metrics_port = procs.free_port()
    argv = service_argv(role, port, model=model, metrics_port=metrics_port, threads=1,
                        device=device_under_test(), extra=("--grace", "5", *extra))
    log_path = tmp / f"{role}-{port}.log"
    env = child_env(1, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    proc = procs.start(argv, env=env, log_path=log_path)
    try:
        procs.wait_healthy(f"127.0.0.1:{port}", proc, timeout=timeout)
    except BaseException:
        procs.stop(proc)
        raise
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub_cls = model_pb2_grpc.TargetServiceStub if role == "target" else model_pb2_grpc.DraftServiceStub
    return Service(role, proc, port, metrics_port, channel, stub_cls(channel), log_path)


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Service]]:
    """A factory for extra service processes; every one is stopped at session end."""
    started: list[Service] = []
    tmp = tmp_path_factory.mktemp("services")

    def factory(role: str, model: Path | None, *extra: str, port: int | None = None,
                timeout: float = 120, env: dict[str, str] | None = None) -> Service:
        svc = launch(role, model, tmp, *extra, port=port, timeout=timeout, env=env)
        started.append(svc)
        return svc

    yield factory
    for svc in started:
        svc.stop()


# Small enough limits that tests can hit each of them.
MAX_K = {"target": 32, "draft": 8}
LIMITS = ("--max-request-tokens", "600")


@pytest.fixture(scope="session")
def target(services: Callable[..., Service], tiny_pair: tuple[Path, Path]) -> Service:
    return services("target", tiny_pair[0], *LIMITS, "--max-k", str(MAX_K["target"]))


@pytest.fixture(scope="session")
def draft(services: Callable[..., Service], tiny_pair: tuple[Path, Path]) -> Service:
    return services("draft", tiny_pair[1], *LIMITS, "--max-k", str(MAX_K["draft"]))


@pytest.fixture(scope="session")
def tokenizer(tiny_pair: tuple[Path, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture(scope="session")
def reference(tiny_pair: tuple[Path, Path]):
    """The tiny target and draft loaded in the test process: full recompute, no cache."""
    import torch

    from engine.model.loader import load

    torch.set_num_threads(1)
    return load(str(tiny_pair[0])).model, load(str(tiny_pair[1])).model


def score(stub, session: str, committed: list[int], cache_position: int, tokens: list[int],
          k: int = 0, **kw) -> model_pb2.ScoreResponse:
    """Score with the prefix hash of committed[:cache_position] filled in."""
    return stub.Score(model_pb2.ScoreRequest(
        session_id=session, cache_position=cache_position,
        prefix_hash=fingerprint(committed[:cache_position]), tokens=tokens, k=k, **kw,
    ), timeout=60)


def propose(stub, session: str, committed: list[int], cache_position: int, tokens: list[int],
            k: int, **kw) -> model_pb2.ProposeResponse:
    return stub.Propose(model_pb2.ProposeRequest(
        session_id=session, cache_position=cache_position,
        prefix_hash=fingerprint(committed[:cache_position]), tokens=tokens, k=k, **kw,
    ), timeout=60)


def temperature(t: float, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=t, **kw)


def scrape(port: int) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for specdec_* series."""
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("specdec_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out

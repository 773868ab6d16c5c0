"""model_service.serve.open_host: `--dtype auto` falls back to float32 where the start-up check finds
the dtype it picked not exact; a dtype asked for by name is refused instead. The check's verdict
is planted (bfloat16 not exact, as on a CPU whose bf16 kernels round by the token count): the
fallback is what is tested, with a real tiny target and the real engine."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import host as engine_host
from engine.model import loader
from model_service import serve
from target_service.role import ROLE


@pytest.fixture
def bf16_inexact(monkeypatch):
    real = engine_host.pick_runner

    def planted(loaded, limits):
        if loaded.dtype == torch.bfloat16 and limits.require_exact:
            raise engine_host.Inexact("planted: not bitwise invariant in bfloat16")
        return real(loaded, limits)

    monkeypatch.setattr(engine_host, "pick_runner", planted)
    monkeypatch.setattr(loader, "auto", lambda device: "bfloat16")  # what a bf16-capable CPU picks


def _args(folder, dtype: str):
    return serve.build_parser(ROLE).parse_args(["--model", str(folder), "--dtype", dtype, "--threads", "1"])


def test_auto_serves_float32_where_its_bfloat16_is_not_exact(tiny_pair, bf16_inexact, caplog) -> None:
    target, _ = tiny_pair
    with caplog.at_level(logging.WARNING, logger="model_service.serve"):
        host = serve.open_host(_args(target, "auto"), ROLE, "r")
    try:
        assert host is not None and host.loaded.dtype == torch.float32
        assert "--dtype auto: bfloat16 is not exact on this device" in caplog.text
    finally:
        host.shutdown()


def test_bfloat16_by_name_is_refused_not_replaced(tiny_pair, bf16_inexact, caplog) -> None:
    target, _ = tiny_pair
    with caplog.at_level(logging.ERROR, logger="model_service.serve"):
        assert serve.open_host(_args(target, "bfloat16"), ROLE, "r") is None
    assert "cannot serve the model: planted" in caplog.text

"""Exactness in the dtypes users serve: float32, bfloat16 and float16 on the tiny target, in-process.

The rule greedy identity and the seeded coupling rest on: a position's logits are bitwise the same
however its forward is shaped, one token at a time (target-only decoding), in a Score of k + 1
tokens, as a token-tree node, packed with other sessions, after a prefill cut anywhere. Checked
against random schedules here and by the start-up check (engine.selfcheck.verify_shapes); the
controls plant a kernel whose rounding follows the forward's shape, which the check must catch
and a target must refuse to serve.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from engine import host, selfcheck
from engine.host import HostLimits, Inexact, pick_runner
from engine.model import llama
from engine.model.linear import InvariantLinear
from engine.runner import PooledRunner
from engine.stock import StockRunner
from tests.unit.test_engine import _run

DTYPES = ("float32", "bfloat16", "float16")
EXACT = HostLimits(require_exact=True, max_k=8)


def _load(tiny_pair, dtype: str):
    from engine.model.loader import load

    torch.set_num_threads(1)
    return load(str(tiny_pair[0]), dtype=dtype)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny target with 64-wide heads (hidden 256): there bf16 SDPA's rounding follows the query
    count, as a real model's does (with the tiny pair's 16-wide heads it happens not to)."""
    from tests.tiny import build_model

    torch.set_num_threads(1)
    return (build_model(tmp_path_factory.mktemp("wide") / "target", seed=0, hidden=256, layers=2),)


def _feed(runner, schedule: list[list[int]]) -> torch.Tensor:
    """One session fed its chunks alone; every position's logits ([tokens, vocab])."""
    return _run(runner, [schedule], [[0]])[0]


def _packed(runner, schedules: list[list[list[int]]], seed: int) -> list[torch.Tensor]:
    """The sessions fed together, each step a random subset of them."""
    out = _run(runner, schedules, [list(range(len(schedules)))], seed=seed)
    return [out[i] for i in range(len(schedules))]


def _cut(tokens: list[int], rng: random.Random) -> list[list[int]]:
    """The stream in random chunks: a prefill of any length, then Scores of 1..9 tokens, some long ones."""
    chunks, at = [], 0
    while at < len(tokens):
        n = rng.choice((1, 1, 2, 3, 5, 9, rng.randrange(10, 40)))
        chunks.append(tokens[at:at + n])
        at += n
    return chunks


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_position_is_bitwise_the_same_however_its_forward_is_shaped(tiny_pair, dtype) -> None:
    loaded = _load(tiny_pair, dtype)
    runner = pick_runner(loaded, EXACT)  # the start-up check passed, or this raises
    assert isinstance(runner, PooledRunner) and runner.forward.dtype == getattr(torch, dtype)
    rng = random.Random(7)
    streams = [[rng.randrange(loaded.vocab_size) for _ in range(rng.randrange(20, 120))] for _ in range(8)]
    one_at_a_time = [_feed(runner, [[t] for t in s]) for s in streams]
    schedules = [_cut(s, rng) for s in streams]
    alone = [_feed(runner, schedule) for schedule in schedules]
    packed = _packed(runner, schedules, seed=3)
    for i in range(len(streams)):
        assert torch.equal(alone[i], one_at_a_time[i]), f"session {i}: chunked alone differs from one at a time"
        assert torch.equal(packed[i], one_at_a_time[i]), f"session {i}: packed differs from one at a time"


def _multi_query_rounding_follows_the_query_count(dtype: torch.dtype, *, head_dim: int) -> bool:
    """Whether a causal SDPA call over n queries gives some query other bits than the same query's
    call alone (with its own prefix of keys), for n in 2..12, on this machine."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        q, k, v = (torch.randn(1, 4, 12, head_dim, generator=gen).to(dtype) for _ in range(3))
        for n in range(2, 13):
            together = torch.nn.functional.scaled_dot_product_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n],
                                                                        is_causal=True)
            for i in range(n):
                alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1],
                                                                         v[:, :, :i + 1])
                if not torch.equal(together[:, :, i:i + 1], alone):
                    return True
    return False


class _MultiQuery(llama.LlamaForward):
    """A planted kernel: every row of several tokens as ONE SDPA call over its queries, in the
    weights' dtype, as the forward computed them before lanes (--no-batch-invariant's attention):
    a query's rounding then follows how many share its call."""

    multi_query = property(lambda self: True, lambda self, value: None)
    # The weights' dtype whatever the host asks (its float32 retry included).
    attention_dtype = property(lambda self: self.dtype, lambda self, value: None)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_a_planted_multi_query_attention_fails_the_check_and_the_target(wide, dtype, monkeypatch) -> None:
    if not _multi_query_rounding_follows_the_query_count(getattr(torch, dtype), head_dim=64):
        pytest.skip(f"multi-query SDPA in {dtype} gives a query the same bits however many share its call "
                    "on this machine: the plant changes nothing to catch")
    loaded = _load(wide, dtype)
    monkeypatch.setattr(host, "LlamaForward", _MultiQuery)
    with pytest.raises(Inexact, match="not bitwise invariant"):
        pick_runner(loaded, EXACT)
    # A draft has nothing to prove (its rounding changes only its guesses): it is served.
    assert isinstance(pick_runner(_load(wide, dtype), HostLimits(max_k=8)), PooledRunner)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_a_planted_unpadded_linear_fails_the_check(tiny_pair, dtype) -> None:
    """F.linear unpadded: its bits change with the token count where its kernel does."""
    loaded = _load(tiny_pair, dtype)
    forward = llama.LlamaForward(loaded.model)
    for layer in forward.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, InvariantLinear(lin.source_weight, lin.bias, onednn=False))
    probe = forward.layers[0].gate_up
    x = torch.randn(40, probe.in_features).to(forward.dtype) * torch.logspace(-2, 2, probe.in_features).to(forward.dtype)
    with torch.inference_mode():
        if all(torch.equal(probe(x[:m]), probe(x)[:m]) for m in range(1, 40)):
            pytest.skip(f"F.linear in {dtype} gives the same bits for every token count on this machine")
        runner = PooledRunner(forward, forward.new_pool(64 << 20), fixed_shapes=False, max_rows=64)
        assert "not bitwise invariant" in selfcheck.verify_shapes(runner, loaded.vocab_size, 8)


def test_the_stock_forward_is_refused_as_a_low_precision_target(tiny_pair, caplog) -> None:
    """transformers' own forward rounds by the token count: a bf16 target through it does not start;
    in float32 it is served with a warning naming what the check found."""
    with pytest.raises(Inexact, match="stock forward"):
        pick_runner(_load(tiny_pair, "bfloat16"), HostLimits(require_exact=True, max_k=8, max_batch=1))
    with caplog.at_level(logging.WARNING, logger="engine.host"):
        runner = pick_runner(_load(tiny_pair, "float32"), HostLimits(require_exact=True, max_k=8, max_batch=1))
    assert isinstance(runner, StockRunner)
    assert any("stock forward" in r.getMessage() for r in caplog.records) or not caplog.records


def test_no_batch_invariant_serves_knowingly_inexact(wide, caplog) -> None:
    loaded = _load(wide, "bfloat16")
    with caplog.at_level(logging.WARNING, logger="engine.host"):
        runner = pick_runner(loaded, HostLimits(require_exact=True, batch_invariant=False, max_k=8))
    assert isinstance(runner, PooledRunner) and runner.forward.multi_query  # the fast, shape-dependent attention
    assert any("may differ from target-only" in r.getMessage() for r in caplog.records)


class _ThreadSplitSDPA:
    """A planted attention kernel as measured on one AMD EPYC in float32: on more than one thread, a
    lane's output moves in the last bits when other lanes share its SDPA call; on one thread it does
    not. (torch.nn.functional otherwise, for the module under test.)"""

    def __init__(self, heads: int) -> None:
        self.heads = heads  # query heads of one lane

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)

    def scaled_dot_product_attention(self, q, *args, **kwargs):
        o = torch.nn.functional.scaled_dot_product_attention(q, *args, **kwargs)
        lanes = q.shape[0] * q.shape[1] // self.heads
        return o * (1 + 2.0 ** -20) if torch.get_num_threads() > 1 and lanes > 1 else o


def test_attention_exact_only_on_one_thread_is_run_on_one_thread(tiny_pair, monkeypatch, caplog) -> None:
    from engine.model import attention

    loaded = _load(tiny_pair, "float32")
    monkeypatch.setattr(attention, "F", _ThreadSplitSDPA(loaded.model.config.num_attention_heads))
    torch.set_num_threads(2)
    try:
        with caplog.at_level(logging.WARNING, logger="engine.host"):
            runner = pick_runner(loaded, EXACT)  # Inexact without the one-thread retry
        assert isinstance(runner, PooledRunner) and runner.forward.attention_threads == 1
        assert any("trying attention on 1 thread" in r.getMessage() for r in caplog.records)
        with torch.inference_mode():  # the control: the plant on 2 threads is caught
            forward = runner.forward
            checker = PooledRunner(forward, forward.new_pool(64 << 20), fixed_shapes=False, max_rows=64)
            assert selfcheck.verify_shapes(checker, loaded.vocab_size, 8) == ""
            forward.attention_threads = 0
            assert "not bitwise invariant" in selfcheck.verify_shapes(checker, loaded.vocab_size, 8)
        assert torch.get_num_threads() == 2  # attention's switch gave the threads back
    finally:
        torch.set_num_threads(1)

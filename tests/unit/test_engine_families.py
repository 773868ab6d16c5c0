"""The engine's pooled forward for the families beyond Llama: Qwen3 (q/k norms, sliding-window
layers) and Gemma 3 (sandwich norms, q/k norms, local and global layers with their own rotary
bases, scaled embeddings), on tiny models of each family built from configs (tests.tiny).

Against the model's own forward over prompts longer than the window (greedy identical,
probabilities to 1e-5); batch invariance alone vs among 8 others, bitwise; the start-up checks
pass, so `pick_runner` serves them batched. The controls: the same checks fail with the window,
the q/k norms or the per-type rotary left out, so they are not vacuous. Gemma 2's attention
soft-capping, which one SDPA call cannot compute, keeps the fallback and says so.
"""
from __future__ import annotations

import pytest
import torch

from engine import selfcheck
from engine.host import HostLimits, pick_runner
from engine.model.linear import calibrate
from engine.model.llama import LlamaForward, unsupported
from engine.runner import PooledRunner
from engine.stock import StockRunner
from tests.unit.test_engine import _run, _schedules, _stock

WINDOW = 8


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family(request, tmp_path_factory):
    from engine.model.loader import load
    from tests.tiny import build_model

    torch.set_num_threads(1)
    folder = build_model(tmp_path_factory.mktemp(request.param) / "target", arch=request.param, layers=2,
                         window=WINDOW)
    loaded = load(str(folder))
    forward = LlamaForward(loaded.model)
    calibrate(forward.linears(), 300)
    return request.param, loaded, PooledRunner(forward, forward.new_pool(64 << 20), fixed_shapes=False, max_rows=64)


def test_the_forward_reads_each_familys_layers(family) -> None:
    arch, loaded, runner = family
    layers = runner.forward.layers
    assert not unsupported(loaded.model)
    assert all(layer.q_norm is not None and layer.k_norm is not None for layer in layers)
    assert [layer.window for layer in layers] == ([None, WINDOW] if arch == "qwen3" else [WINDOW, None])
    if arch == "gemma3":
        assert all(layer.attn_out_norm is not None and layer.mlp_out_norm is not None for layer in layers)
        assert [layer.rope for layer in layers] == ["sliding_attention", "full_attention"]


def test_pooled_forward_equals_the_models_own_past_the_window(family) -> None:
    _, loaded, runner = family
    schedules = _schedules(6, seed=1)
    batched = _run(runner, schedules, [list(range(6))])
    longest = 0
    for i, chunks in enumerate(schedules):
        stock = _stock(loaded.model, chunks)
        longest = max(longest, stock.shape[0])
        assert torch.equal(batched[i].argmax(-1), stock.argmax(-1))
        torch.testing.assert_close(torch.softmax(batched[i], -1), torch.softmax(stock, -1), atol=1e-5, rtol=0)
    assert longest > 4 * WINDOW  # the window really cuts


def test_a_session_is_bitwise_the_same_alone_and_batched(family) -> None:
    _, _, runner = family
    schedules = _schedules(9, seed=2)
    alone = _run(runner, schedules, [[i] for i in range(9)])
    batched = _run(runner, schedules, [list(range(9))], seed=9)
    for i in range(9):
        assert torch.equal(alone[i], batched[i]), f"session {i} differs: batch invariance lost"


@pytest.mark.parametrize("broken", ["window", "q/k norms", "rotary per type"])
def test_the_start_up_check_catches_a_forward_that_skips_a_family_feature(family, broken) -> None:
    arch, loaded, _ = family
    if broken == "rotary per type" and arch != "gemma3":
        pytest.skip("only Gemma 3 has a rotary embedding per layer type")
    forward = LlamaForward(loaded.model)
    assert selfcheck.numerics(PooledRunner(forward, forward.new_pool(8 << 20), fixed_shapes=False, max_rows=8),
                              loaded.model, loaded.vocab_size) == ""
    for layer in forward.layers:
        if broken == "window":
            layer.window = None
        elif broken == "q/k norms":
            layer.q_norm = layer.k_norm = None
        else:
            layer.rope = forward.rope_types[0]
    reason = selfcheck.numerics(PooledRunner(forward, forward.new_pool(8 << 20), fixed_shapes=False, max_rows=8),
                                loaded.model, loaded.vocab_size)
    assert "differ from the model's" in reason


def test_pick_runner_serves_the_family_batched(family) -> None:
    _, loaded, _ = family
    assert isinstance(pick_runner(loaded, HostLimits()), PooledRunner)


def test_attention_soft_capping_keeps_the_fallback_and_says_so(family) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    _, loaded, _ = family
    import dataclasses

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)
    gemma2 = Gemma2ForCausalLM(config).eval()
    assert unsupported(gemma2) == "attention logit soft-capping"
    assert isinstance(pick_runner(dataclasses.replace(loaded, model=gemma2, name="gemma2"), HostLimits()), StockRunner)

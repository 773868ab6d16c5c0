"""The row-wise packed forward (specdec.hosting.rows) in-process on the tiny target.

Against the stock transformers forward (greedy identical, probabilities to
1e-5), batch invariance (a session's logits alone vs among 8 or 16 others,
bitwise), the KV buffers, the start-up checks and the prefill chunking.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec.hosting import rows
from specdec.hosting.batching import chunk_of


@pytest.fixture(scope="module")
def loaded(tiny_pair):
    from specdec.hosting.loader import load

    torch.set_num_threads(1)
    return load(str(tiny_pair[0]))


@pytest.fixture(scope="module")
def forward(loaded):
    tokens, kept = rows.calibrate(loaded.model, 300, 300)
    rows.enable(loaded.model)
    yield rows.RowsForward(loaded.model, tokens, kept)
    loaded.model.config._attn_implementation = "sdpa"


def _schedules(n_sessions: int, seed: int) -> list[list[list[int]]]:
    """Per session its token chunks: a prompt of 3..40 tokens, then 1..6-token steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sessions):
        chunks = [[rng.randrange(384) for _ in range(rng.randrange(3, 41))]]
        for _ in range(rng.randrange(4, 10)):
            chunks.append([rng.randrange(384) for _ in range(rng.randrange(1, 7))])
        out.append(chunks)
    return out


def _run(forward: rows.RowsForward, schedules, groups: list[list[int]], seed: int = 0,
         participation: float = 0.7) -> dict[int, torch.Tensor]:
    """Feed every session its chunks; sessions in a group share forwards (random joins and leaves)."""
    rng = random.Random(seed)
    out: dict[int, list[torch.Tensor]] = {}
    for group in groups:
        kvs = {i: forward.new_cache() for i in group}
        at = {i: 0 for i in group}
        out.update({i: [] for i in group})
        while any(at[i] < len(schedules[i]) for i in group):
            live = [i for i in group if at[i] < len(schedules[i])]
            step = [i for i in live if rng.random() < participation] or live[:1]
            batch = [rows.Row(kvs[i], schedules[i][at[i]], len(schedules[i][at[i]])) for i in step]
            with torch.inference_mode():
                for i, logits in zip(step, forward(batch)):
                    out[i].append(logits.clone())
                    at[i] += 1
    return {i: torch.cat(chunks) for i, chunks in out.items()}  # [tokens, vocab]


def _stock(model, chunks: list[list[int]]) -> torch.Tensor:
    from transformers import DynamicCache

    model.config._attn_implementation = "sdpa"
    try:
        cache, at, out = DynamicCache(config=model.config), 0, []
        with torch.inference_mode():
            for c in chunks:
                logits = model(input_ids=torch.tensor([c]), position_ids=torch.arange(at, at + len(c))[None],
                               cache=cache, use_cache=True, logits_to_keep=len(c)).logits[0]
                out.append(logits)
                at += len(c)
    finally:
        model.config._attn_implementation = rows.ATTENTION
    return torch.cat(out)


def test_row_wise_equals_the_stock_forward(loaded, forward) -> None:
    schedules = _schedules(6, seed=1)
    batched = _run(forward, schedules, [list(range(6))])
    for i, chunks in enumerate(schedules):
        stock = _stock(loaded.model, chunks)
        assert torch.equal(batched[i].argmax(-1), stock.argmax(-1))
        torch.testing.assert_close(torch.softmax(batched[i], -1), torch.softmax(stock, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [8, 16])
def test_a_session_is_bitwise_the_same_alone_and_batched(forward, size) -> None:
    schedules = _schedules(16, seed=2)
    alone = _run(forward, schedules, [[i] for i in range(16)])
    batched = _run(forward, schedules, [list(range(j, j + size)) for j in range(0, 16, size)], seed=size)
    for i in range(16):
        assert torch.equal(alone[i], batched[i]), f"session {i} differs: batch invariance lost"


def test_calibrated_padding(loaded) -> None:
    tokens, kept = rows.calibrate(loaded.model, 100, 40)
    for padding in (tokens, kept):
        padded = [padding.pad(m) for m in range(1, 101)]
        assert all(p >= m for m, p in zip(range(1, 101), padded))
        assert padded == sorted(padded)
        assert all(padding.pad(p) == p for p in padded)  # a padded count is itself safe
    assert rows.RowPadding.off().pad(1) == 1


def test_session_kv_grows_and_crops(loaded, forward) -> None:
    kv = forward.new_cache()
    prompt = list(range(10, 30))
    with torch.inference_mode():
        first = forward([rows.Row(kv, prompt, 1)])[0]
    assert kv.length == 20 and kv.capacity == 20  # the first reserve is exact
    element = 4 * 2 * 2 * 16  # float32 x (k, v) x kv heads x head dim
    assert kv.nbytes == 20 * element * loaded.num_layers
    with torch.inference_mode():
        forward([rows.Row(kv, [7], 1)])
    assert kv.length == 21 and kv.capacity == 40  # doubled, content copied
    kv.crop(19)
    with torch.inference_mode():
        again = forward([rows.Row(kv, prompt[19:], 1)])[0]
    fresh = forward.new_cache()
    with torch.inference_mode():
        forward([rows.Row(fresh, prompt[:19], 1)])
        expected = forward([rows.Row(fresh, prompt[19:], 1)])[0]
    assert torch.equal(again, expected)  # cropped back and refed: the bits of a fresh session
    torch.testing.assert_close(again, first, atol=1e-5, rtol=0)


def test_unsupported_models_are_named(loaded) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    from specdec.hosting.host import HostLimits, StockForward, pick_forward

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    mistral = MistralForCausalLM(config).eval()
    assert "sliding" in rows.unsupported(mistral)
    fallback = pick_forward(dataclasses.replace(loaded, model=mistral, name="mistral"), HostLimits())
    assert isinstance(fallback, StockForward)
    assert isinstance(pick_forward(loaded, HostLimits(max_batch=1)), StockForward)


def test_prefill_chunks_sit_at_fixed_positions() -> None:
    assert chunk_of(0, 200, 1, 64) == (64, 0)
    assert chunk_of(64, 136, 1, 64) == (64, 0)
    assert chunk_of(128, 72, 1, 64) == (64, 0)
    assert chunk_of(192, 8, 1, 64) == (8, 1)
    assert chunk_of(10, 60, 5, 64) == (54, 0)  # kept positions 65..69 lie after the cut
    assert chunk_of(10, 60, 8, 64) == (60, 8)  # the cut would split off kept positions
    assert chunk_of(60, 10, 0, 64) == (4, 0)
    assert chunk_of(0, 64, 0, 64) == (64, 0)
    assert chunk_of(0, 500, 3, 0) == (500, 3)  # chunking off


@pytest.mark.slow
def test_embedded_target_is_batch_invariant_on_suite_prompts() -> None:
    """SmolLM2: a few suite prompts then decode steps, alone vs 8 at once, bitwise."""
    import json
    from pathlib import Path

    from specdec.hosting.loader import load

    torch.set_num_threads(1)
    lm = load(None)
    tokens, kept = rows.calibrate(lm.model, 300, 300)
    rows.enable(lm.model)
    fwd = rows.RowsForward(lm.model, tokens, kept)
    suite = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "suite-v1.jsonl"
    lines = [json.loads(line) for line in suite.read_text().splitlines() if line.strip()][:8]
    rng = random.Random(3)
    schedules = []
    for row in lines:
        ids = lm.tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompt = lm.tokenizer(ids)["input_ids"]
        schedules.append([prompt] + [[rng.randrange(lm.vocab_size) for _ in range(rng.randrange(1, 5))]
                                     for _ in range(6)])
    alone = _run(fwd, schedules, [[i] for i in range(len(schedules))])
    batched = _run(fwd, schedules, [list(range(len(schedules)))], seed=8)
    for i in range(len(schedules)):
        assert torch.equal(alone[i], batched[i])


def test_batch_invariance_can_be_switched_off(loaded) -> None:
    from specdec.hosting.host import HostLimits, pick_forward

    try:
        fast = pick_forward(loaded, HostLimits(batch_invariant=False))
        assert fast.tokens_padding.pad(1) == 1 and fast.kept_padding.pad(1) == 1
    finally:
        loaded.model.config._attn_implementation = rows.ATTENTION

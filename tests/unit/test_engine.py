"""The engine's pooled forward in-process on the tiny target.

Against the model's own forward (greedy identical, probabilities to 1e-5),
batch invariance (a session's logits alone vs among 8 or 16 others, bitwise,
with sessions joining and leaving), the KV pool, the attention groups, the
operation count per forward, the start-up checks and the prefill chunking.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import (LANE_BLOCK, ONE_QUERY_GROUP_KEYS, SHARED_FROM, key_bucket, one_query_lengths,
                                    plan_attention)
from engine.host import HostLimits, pick_runner
from engine.model.linear import InvariantLinear, calibrate
from engine.model.llama import LlamaForward, sliding_window, unsupported
from engine.plan import RowPlan, StepPlan
from engine.pool import BLOCK_SIZE, KVPool, PoolExhausted
from engine.runner import PooledRunner
from engine.scheduler import chunk_of
from engine.stock import StockRunner, cache_kwarg


@pytest.fixture(scope="module")
def loaded(tiny_pair):
    from engine.model.loader import load

    torch.set_num_threads(1)
    return load(str(tiny_pair[0]))


@pytest.fixture(scope="module")
def runner(loaded):
    forward = LlamaForward(loaded.model)
    calibrate(forward.linears(), 300)
    return PooledRunner(forward, forward.new_pool(64 << 20), fixed_shapes=False, max_rows=64)


def _schedules(n_sessions: int, seed: int, longest: int = 80) -> list[list[list[int]]]:
    """Per session its token chunks: a prompt of 3..longest tokens, then 1..6-token steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sessions):
        chunks = [[rng.randrange(384) for _ in range(rng.randrange(3, longest + 1))]]
        for _ in range(rng.randrange(4, 10)):
            chunks.append([rng.randrange(384) for _ in range(rng.choice((1, 1, 2, 3, 5, 6)))])
        out.append(chunks)
    return out


def _run(runner, schedules, groups: list[list[int]], seed: int = 0,
         participation: float = 0.7) -> dict[int, torch.Tensor]:
    """Feed every session its chunks; sessions in a group share forwards (random joins and leaves)."""
    rng = random.Random(seed)
    out: dict[int, list[torch.Tensor]] = {}
    for group in groups:
        caches = {i: runner.new_cache() for i in group}
        at = {i: 0 for i in group}
        out.update({i: [] for i in group})
        while any(at[i] < len(schedules[i]) for i in group):
            live = [i for i in group if at[i] < len(schedules[i])]
            step = [i for i in live if rng.random() < participation] or live[:1]
            rows = []
            for i in step:
                tokens = schedules[i][at[i]]
                caches[i].reserve(caches[i].length + len(tokens))
                rows.append(RowPlan(caches[i], tokens, caches[i].length, len(tokens)))
            with torch.inference_mode():
                logits = runner.logits(StepPlan(rows))
            offset = 0
            for i, row in zip(step, rows):
                out[i].append(logits[offset:offset + row.emit].clone())
                offset += row.emit
                at[i] += 1
        for cache in caches.values():
            cache.free()
    return {i: torch.cat(chunks) for i, chunks in out.items()}  # [tokens, vocab]


def _stock(model, chunks: list[list[int]]) -> torch.Tensor:
    from transformers import DynamicCache

    cache, at, out = DynamicCache(config=model.config), 0, []
    with torch.inference_mode():
        for c in chunks:
            logits = model(input_ids=torch.tensor([c]), position_ids=torch.arange(at, at + len(c))[None],
                           use_cache=True, logits_to_keep=len(c), **{cache_kwarg(model): cache}).logits[0]
            out.append(logits)
            at += len(c)
    return torch.cat(out)


def test_pooled_forward_equals_the_models_own(loaded, runner) -> None:
    schedules = _schedules(6, seed=1)
    batched = _run(runner, schedules, [list(range(6))])
    for i, chunks in enumerate(schedules):
        stock = _stock(loaded.model, chunks)
        assert torch.equal(batched[i].argmax(-1), stock.argmax(-1))
        torch.testing.assert_close(torch.softmax(batched[i], -1), torch.softmax(stock, -1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [8, 16])
def test_a_session_is_bitwise_the_same_alone_and_batched(runner, size) -> None:
    schedules = _schedules(16, seed=2)
    alone = _run(runner, schedules, [[i] for i in range(16)])
    batched = _run(runner, schedules, [list(range(j, j + size)) for j in range(0, 16, size)], seed=size)
    for i in range(16):
        assert torch.equal(alone[i], batched[i]), f"session {i} differs: batch invariance lost"


def test_a_session_is_bitwise_the_same_alone_and_among_rows_of_other_lengths(runner) -> None:
    """Prompts of 3..400 tokens: the decode rows of one forward fall in several length groups."""
    schedules = _schedules(16, seed=4, longest=400)
    for chunks in schedules:  # decode steps only after the prompt: one-query rows throughout
        chunks[1:] = [[t[0]] for t in chunks[1:]]
    lengths = [len(c[0]) + 1 for c in schedules]
    assert len(set(one_query_lengths(lengths))) >= 2  # the batch really splits
    alone = _run(runner, schedules, [[i] for i in range(16)])
    batched = _run(runner, schedules, [list(range(16))], seed=5, participation=0.9)
    for i in range(16):
        assert torch.equal(alone[i], batched[i]), f"session {i} differs: batch invariance lost"


def test_one_query_rows_are_grouped_by_length() -> None:
    # Alone: its own length, rounded up to 16.
    assert one_query_lengths([1]) == [16] and one_query_lengths([100]) == [112]
    # 60 short rows and 4 long ones: two groups, the short rows not padded to 400.
    short, long = [40 + i % 20 for i in range(60)], [380, 390, 395, 400]
    padded = one_query_lengths(short + long)
    assert set(padded[:60]) == {64} and set(padded[60:]) == {400}
    # One row a little longer than many short ones: cheaper padded along than as a group of its own...
    assert set(one_query_lengths([30] * 8 + [70])) == {80}  # 8 rows x 48 more keys <= the group cost
    # ...but not when that pads too many rows.
    many = one_query_lengths([30] * 40 + [70])
    assert many[:40] == [32] * 40 and many[40] == 80 and 40 * 48 > ONE_QUERY_GROUP_KEYS
    # A group's padding depends only on the lengths, not on the rows' order.
    mixed = short + long
    random.Random(0).shuffle(mixed)
    assert sorted(one_query_lengths(mixed)) == sorted(padded)


def test_a_kernel_that_varies_with_the_row_count_is_caught(loaded) -> None:
    """The control: the same check fails with F.linear unpadded, whose bits change with the token count M."""
    forward = LlamaForward(loaded.model)
    for layer in forward.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, InvariantLinear(lin.source_weight, lin.bias, onednn=False))
    probe = forward.layers[0].gate_up
    x = torch.randn(40, probe.in_features)
    with torch.inference_mode():
        varies = any(not torch.equal(probe(x[:m]), probe(x)[:m]) for m in range(1, 40))
    if not varies:
        pytest.skip("F.linear gives the same bits for every token count on this machine")
    unpadded = PooledRunner(forward, forward.new_pool(64 << 20), fixed_shapes=False, max_rows=64)
    schedules = [[[5, 6, 7, 8, 9]] + [[t] for t in range(20, 40)] for _ in range(16)]
    alone = _run(unpadded, schedules, [[i] for i in range(16)])
    batched = _run(unpadded, schedules, [list(range(16))], participation=1.0)
    assert any(not torch.equal(alone[i], batched[i]) for i in range(16))


def test_calibration_pads_make_every_count_agree(loaded) -> None:
    weight = loaded.model.model.layers[0].mlp.down_proj.weight
    lin = InvariantLinear(weight, None, onednn=LlamaForward(loaded.model).onednn)
    calibrate([lin], 100)
    x = torch.randn(100, lin.in_features) * torch.logspace(-2, 2, lin.in_features)
    with torch.inference_mode():
        reference = lin(x)
        for m in range(1, 100):
            assert torch.equal(lin(x[:m]), reference[:m]), f"{m} rows"


def test_calibration_finds_a_split_that_only_some_rows_alone_show() -> None:
    """A planted kernel whose bits for one token computed alone differ from the same token's among
    others, for a token that is not the input's first (what F.linear did in float16 on an Intel CPU
    with AVX-512 FP16): calibration must see it, not take the first rows' agreement for every row's."""
    from engine.model.linear import _agreeing, _candidates

    # Small integers: every kernel computes them exactly, so only the plant can split a count.
    weight = torch.randint(-3, 4, (8, 16), generator=torch.Generator().manual_seed(0)).float()

    def planted(x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, weight)
        return out + 2 ** -10 if x.shape[0] == 1 and float(x[0, 0]) > 1.5 else out  # by value, not position

    x = torch.randint(-3, 4, (64, 16), generator=torch.Generator().manual_seed(1)).float()
    x[:, 0] = 0.0
    x[5, 0] = 2.0  # the one odd token: the sixth
    counts = _candidates(64)
    agree = _agreeing(planted, x, counts)
    assert agree[0] is False  # one token alone: the odd class
    assert all(agree[1:])  # from two tokens on every count agrees
    assert all(_agreeing(lambda t: F.linear(t, weight), x, counts))  # the control: a kernel with no split


def test_pool_blocks_grow_crop_and_free() -> None:
    block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers x (k, v) x tokens x kv heads x head dim x fp32
    pool = KVPool(2, 2, 16, torch.float32, torch.device("cpu"), budget_bytes=10 * block)
    assert pool.block_bytes == block
    assert pool.num_blocks == 11 and pool.free_blocks == 10  # block 0 is the scratch block
    kv = pool.new_session()
    kv.reserve(BLOCK_SIZE + 1)
    assert len(kv.blocks) == 2 and 0 not in kv.blocks
    assert kv.nbytes == 2 * pool.block_bytes
    kv.length = BLOCK_SIZE + 1
    kv.crop(BLOCK_SIZE)
    assert len(kv.blocks) == 1 and pool.free_blocks == 9
    assert kv.slots(0, 3) == [kv.blocks[0] * BLOCK_SIZE + p for p in range(3)]
    other = pool.new_session()
    with pytest.raises(PoolExhausted):
        other.reserve(10 * BLOCK_SIZE)
    assert other.blocks == []  # a failed reserve takes nothing
    kv.free()
    assert pool.free_blocks == 10


def test_every_token_is_a_lane_grouped_by_its_own_key_length() -> None:
    assert [key_bucket(n) for n in (1, 64, 65, 200, 700)] == [64, 64, 128, 256, 1024]
    pool = KVPool(1, 1, 8, torch.float32, torch.device("cpu"), budget_bytes=1 << 20)
    rows = []
    for past, n in [(10, 1)] * 16 + [(30, 5), (30, 4), (100, 5), (0, 64), (0, 40), (10, 150)]:
        kv = pool.new_session()
        kv.reserve(past + n)
        kv.length = past
        rows.append((kv, past, n, None))
    plan = plan_attention(pool, rows, sum(n for _, _, n, _ in rows), torch.device("cpu"))
    lanes = [g for g in plan.groups if not g.shared and not g.fold]
    # 16 decode lanes, one query each, grouped by padded key length only.
    assert [g.size for g in lanes] == [16] and lanes[0].length == 16
    assert lanes[0].mask.shape == (16, 1, 1, 16) and lanes[0].mask.sum(-1).flatten().tolist() == [11] * 16
    # Score rows gather their keys once, their lanes folded into the head axis: by n, then by
    # padded length (the 5-token rows at 30 and 100 share one call, padded to 112).
    folded = sorted((g.fold, g.size, g.length) for g in plan.groups if g.fold)
    assert folded == [(4, 1, 48), (5, 2, 112)]
    five = next(g for g in plan.groups if g.fold == 5)
    assert five.kv_index.shape == (2 * 112,) and five.q_index.tolist() == list(range(16, 21)) + list(range(25, 30))
    assert five.mask.shape == (2, 5, 112) and five.mask.sum(-1).tolist() == [list(range(31, 36)), list(range(101, 106))]
    # Long rows (prefill chunks) share one gather per block of LANE_BLOCK lanes, each lane masked
    # to its own position: 64 -> 1 block, 40 -> 1, 150 tokens after 10 -> 3.
    shared = [g for g in plan.groups if g.shared]
    assert SHARED_FROM <= 40 and [g.size for g in shared] == [64, 40, LANE_BLOCK, LANE_BLOCK, 150 - 2 * LANE_BLOCK]
    last = shared[-1]
    assert last.length == 160 and last.kv_index.shape == (160,)
    assert last.mask[:, 0, 0].sum(-1).tolist() == list(range(10 + 2 * LANE_BLOCK + 1, 161))


def test_a_tree_nodes_lane_reads_its_path_in_order() -> None:
    """A node's keys: the held prefix, then its ancestors by depth, then itself (never a gap)."""
    from engine.tree import PendingTree

    pool = KVPool(1, 1, 8, torch.float32, torch.device("cpu"), budget_bytes=1 << 20)
    kv = pool.new_session()
    kv.reserve(40)
    kv.length = 30
    tree = PendingTree(30, 0).row(0, [-1, -1, 0, 0, 2])
    plan = plan_attention(pool, [(kv, 30, 5, tree)], 5, torch.device("cpu"))
    (group,) = plan.groups
    keys = group.kv_index.view(group.size, group.length)
    slot = {p: kv.slots(p, 1)[0] for p in range(35)}
    # node 4's path is 0 -> 2 -> 4: keys 0..29, then storage 30, 32, 34.
    assert keys[4, :33].tolist() == [slot[p] for p in range(30)] + [slot[30], slot[32], slot[34]]
    assert group.mask[4, 0, 0].sum() == 33 and group.mask[1, 0, 0].sum() == 31


def _ops_per_forward(runner, sessions: int) -> int:
    caches = []
    for i in range(sessions):
        cache = runner.new_cache()
        cache.reserve(41)
        with torch.inference_mode():
            runner.logits(StepPlan([RowPlan(cache, [5 + i] * 40, 0, 1)]))
        caches.append(cache)
    rows = [RowPlan(c, [7], c.length, 1) for c in caches]
    for c in caches:
        c.reserve(c.length + 1)
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.logits(StepPlan(rows))
    for c in caches:
        c.free()
    return sum(e.count for e in prof.key_averages())


def test_operations_per_forward_do_not_grow_with_the_sessions(runner) -> None:
    one, sixteen = _ops_per_forward(runner, 1), _ops_per_forward(runner, 16)
    assert sixteen <= 1.1 * one, (one, sixteen)


def test_unsupported_models_are_named(loaded) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4)).eval()
    assert "model type 'gpt2'" in unsupported(gpt2)
    fallback = pick_runner(dataclasses.replace(loaded, model=gpt2, name="gpt2"), HostLimits())
    assert isinstance(fallback, StockRunner)
    assert isinstance(pick_runner(loaded, HostLimits(max_batch=1)), StockRunner)
    # Mistral's sliding window is served: every layer's window is the config's.
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    mistral = MistralForCausalLM(config).eval()
    assert unsupported(mistral) == "" and [sliding_window(mistral, i) for i in range(2)] == [8, 8]


def test_prefill_chunks_sit_at_fixed_positions() -> None:
    assert chunk_of(0, 200, 1, 64) == (64, 0)
    assert chunk_of(64, 136, 1, 64) == (64, 0)
    assert chunk_of(128, 72, 1, 64) == (64, 0)
    assert chunk_of(192, 8, 1, 64) == (8, 1)
    assert chunk_of(10, 60, 5, 64) == (54, 0)  # emitted positions 65..69 lie after the cut
    assert chunk_of(10, 60, 8, 64) == (60, 8)  # the cut would split off emitted positions
    assert chunk_of(60, 10, 0, 64) == (4, 0)
    assert chunk_of(0, 64, 0, 64) == (64, 0)
    assert chunk_of(0, 500, 3, 0) == (500, 3)  # chunking off


@pytest.mark.slow
def test_embedded_target_is_batch_invariant_on_suite_prompts() -> None:
    """SmolLM2: a few suite prompts then steps of 1..6 tokens, alone vs 8 at once, bitwise."""
    import json
    from pathlib import Path

    from engine.model.loader import load

    torch.set_num_threads(1)
    lm = load(None)
    forward = LlamaForward(lm.model)
    calibrate(forward.linears(), 300)
    fwd = PooledRunner(forward, forward.new_pool(256 << 20), fixed_shapes=False, max_rows=64)
    suite = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "suite-v1.jsonl"
    lines = [json.loads(line) for line in suite.read_text().splitlines() if line.strip()][:8]
    rng = random.Random(3)
    schedules = []
    for row in lines:
        ids = lm.tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompt = lm.tokenizer(ids)["input_ids"]
        schedules.append([prompt] + [[rng.randrange(lm.vocab_size) for _ in range(rng.choice((1, 1, 2, 5, 6)))]
                                     for _ in range(6)])
    alone = _run(fwd, schedules, [[i] for i in range(len(schedules))])
    batched = _run(fwd, schedules, [list(range(len(schedules)))], seed=8)
    for i in range(len(schedules)):
        assert torch.equal(alone[i], batched[i])


def test_batch_invariance_can_be_switched_off(loaded) -> None:
    fast = pick_runner(loaded, HostLimits(batch_invariant=False))
    assert isinstance(fast, PooledRunner)
    assert all(lin.pad_to == 1 for lin in fast.forward.linears())


def test_the_compiled_forward_gives_the_eager_bits(tiny_pair) -> None:
    """--compile: the norms and the activation through torch.compile, the same logits as eager."""
    from engine.model.loader import load

    eager = pick_runner(load(str(tiny_pair[0])), HostLimits())
    compiled = pick_runner(load(str(tiny_pair[0])), HostLimits(compile=True))
    assert isinstance(compiled, PooledRunner)
    schedules = _schedules(4, seed=5)
    a = _run(eager, schedules, [list(range(4))], seed=1)
    b = _run(compiled, schedules, [list(range(4))], seed=1)
    for i in range(4):
        assert torch.equal(a[i].argmax(-1), b[i].argmax(-1))
        torch.testing.assert_close(a[i], b[i], atol=1e-4, rtol=0)


def test_the_stock_runner_emits_the_last_positions_of_a_multi_token_step(tiny_pair) -> None:
    """The runner for models the engine does not know (and --max-batch 1): a 7-token step
    emitting 3 positions gives the model's own logits there. Its own copy of the model: the
    module's is handed to the packed forward by the tests above."""
    from engine.model.loader import load

    loaded = load(str(tiny_pair[0]))
    runner = StockRunner(loaded.model)
    cache = runner.new_cache()
    tokens = [5, 9, 14, 3, 77, 21, 8]
    with torch.inference_mode():
        got = runner.logits(StepPlan([RowPlan(cache, tokens, 0, 3)]))
        want = loaded.model(torch.tensor([tokens])).logits[0, -3:]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# --------------------------------------------------------------------- token trees (engine.tree)

TREE_PREFIX = [5, 9, 13, 7, 21, 2, 40, 41, 60, 3]
TREE_TOKENS = [100, 101, 102, 103, 104, 105]
TREE_PARENTS = [-1, -1, 0, 0, 2, 1]  # a b | c d under a | e under c | f under b


def _chain_logits(runner, tokens: list[int]) -> torch.Tensor:
    """The last position's logits of `tokens` fed as one chain on a fresh cache."""
    cache = runner.new_cache()
    cache.reserve(len(tokens))
    with torch.inference_mode():
        out = runner.logits(StepPlan([RowPlan(cache, tokens, 0, 1)]))[-1]
    cache.free()
    return out


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    paths = []
    for i, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[i]])
    return paths


@pytest.mark.parametrize("company", [0, 5], ids=["alone", "among-5"])
def test_a_tree_row_gives_every_node_its_paths_logits(runner, company) -> None:
    """A Score-like row: the last held token, then six tree nodes; each node's logits are those of
    the chain along its path (argmax equal, probabilities to 1e-5), whoever shares the forward."""
    from engine.tree import PendingTree

    cache = runner.new_cache()
    held = TREE_PREFIX[:-1]
    cache.reserve(len(TREE_PREFIX) + len(TREE_TOKENS))
    with torch.inference_mode():
        runner.logits(StepPlan([RowPlan(cache, held, 0, 1)]))
    tree = PendingTree(len(TREE_PREFIX), 0).row(1, TREE_PARENTS)
    row = RowPlan(cache, [TREE_PREFIX[-1], *TREE_TOKENS], len(held), len(TREE_TOKENS) + 1, tree=tree)
    others = []
    for i in range(company):
        c = runner.new_cache()
        c.reserve(30)
        others.append(RowPlan(c, [7 + i] * (3 + i), 0, 1))
    with torch.inference_mode():
        logits = runner.logits(StepPlan([*others, row]))[company:]
    for c in others:
        c.cache.free() if hasattr(c.cache, "cache") else c.cache.free()
    want = [_chain_logits(runner, TREE_PREFIX)] + [_chain_logits(runner, TREE_PREFIX + p)
                                                   for p in _paths(TREE_PARENTS, TREE_TOKENS)]
    for got, chain in zip(logits, want):
        assert int(got.argmax()) == int(chain.argmax())
        torch.testing.assert_close(torch.softmax(got, -1), torch.softmax(chain, -1), atol=1e-5, rtol=0)
    cache.free()


def test_a_session_takes_up_the_path_the_next_call_names(runner) -> None:
    """Nodes stay pending above the held prefix; the next call's (cache_position, prefix_hash)
    names a path, whose K/V moves into place: what follows is computed as after that chain."""
    from engine.sessions import CachedSession
    from specdec.core.fingerprint import fingerprint

    cache = runner.new_cache()
    session = CachedSession("tree", cache)
    cache.reserve(len(TREE_PREFIX) + len(TREE_TOKENS) + 1)
    with torch.inference_mode():
        runner.logits(StepPlan([RowPlan(cache, TREE_PREFIX, 0, 1)]))
    session.append(TREE_PREFIX)
    from engine.tree import PendingTree

    row = RowPlan(cache, TREE_TOKENS, session.stored, len(TREE_TOKENS),
                  tree=PendingTree(session.length, 0).row(0, TREE_PARENTS))
    with torch.inference_mode():
        runner.logits(StepPlan([row]))
    session.append(TREE_TOKENS, TREE_PARENTS)
    assert session.length == len(TREE_PREFIX) and session.stored == len(TREE_PREFIX) + len(TREE_TOKENS)
    path = [100, 102, 104]  # a, c, e
    assert not session.take_path(len(TREE_PREFIX) + 3, fingerprint(TREE_PREFIX + [100, 103, 104]))
    assert session.take_path(len(TREE_PREFIX) + 3, fingerprint(TREE_PREFIX + path))
    assert session.length == session.stored == len(TREE_PREFIX) + 3 and session.tree is None
    with torch.inference_mode():
        after = runner.logits(StepPlan([RowPlan(cache, [77], session.stored, 1)]))[-1]
    want = _chain_logits(runner, TREE_PREFIX + path + [77])
    assert int(after.argmax()) == int(want.argmax())
    torch.testing.assert_close(torch.softmax(after, -1), torch.softmax(want, -1), atol=1e-5, rtol=0)
    cache.free()

"""A published-layout EAGLE-3 head end to end: the draft service loads the folder as written,
the orchestrator learns the layers it reads from GetInfo and asks the target for them. A head that
vLLM's `speculators` wrote (its own format) serves the same way, alone and among 8 streams.

Tiny models, real processes (tests.tiny.build_eagle3_head writes the folder). Greedy output is
target-only's in every mode, alone and among concurrent streams; every round's feature bytes are
the two layers' rows (fp16), both ways.
"""
from __future__ import annotations

import pytest
import torch

from client import Client
from tests.integration.stack import Stack, complete_concurrently

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "Speculative decoding drafts a few"]
N_NEW = 24
LAYERS = (0, 1)


@pytest.fixture(scope="module")
def eagle3_stack(tiny_pair, tmp_path_factory):
    from tests.tiny import build_eagle3_head

    target_dir, _ = tiny_pair
    root = tmp_path_factory.mktemp("eagle3")
    torch.set_num_threads(1)
    head_dir = build_eagle3_head(target_dir, root / "head", layers=LAYERS)
    s = Stack(logs=root)
    try:
        t = s.start_service("target", "target", target_dir, register=False, wait=False)
        d = s.start_service("draft", "draft", head_dir, register=False, wait=False,
                            extra=("--base-model", str(target_dir)))
        s.wait_serving("target")
        s.wait_serving("draft")
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d], extra=("--rate-per-tenant", "0"))
        with Client(s.addresses["orch"], timeout=120) as c:
            yield s, c, target_dir
    finally:
        s.stop()


def test_greedy_is_target_only_in_every_mode(eagle3_stack):
    _, c, target_dir = eagle3_stack
    from transformers import AutoConfig, AutoTokenizer

    dim = AutoConfig.from_pretrained(target_dir).hidden_size
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafted = 0
    for prompt in PROMPTS:
        ref = c.complete(prompt, max_new_tokens=N_NEW, proposer="none")
        for options in (dict(proposer="draft", k=1), dict(proposer="draft", k=4),
                        dict(proposer="draft", k=3, parallel=True), dict(proposer="combined", k=4),
                        dict(proposer="draft")):
            out = c.complete(prompt, max_new_tokens=N_NEW, **options)
            assert list(out.token_ids) == list(ref.token_ids), (prompt, options)
            s = out.stats
            assert not s.fallback_reason and s.cache_misses == 0, (options, s.fallback_reason)
            assert s.feature_bytes == sum(r.feature_bytes for r in s.rounds) > 0
            if options.get("k"):
                drafted += s.drafted_tokens
        # Round 1 brings the prompt's rows: both layers, 2 bytes a value.
        out = c.complete(prompt, max_new_tokens=8, proposer="draft", k=3)
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        assert out.stats.rounds[0].feature_bytes == prompt_len * len(LAYERS) * dim * 2
        assert all(r.feature_bytes % (len(LAYERS) * dim * 2) == 0 for r in out.stats.rounds)
    assert drafted > 0


def test_concurrent_streams_are_each_target_only(eagle3_stack):
    stack, c, _ = eagle3_stack
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    refs = [list(c.complete(p, max_new_tokens=16, proposer="none").token_ids) for p in prompts]
    outs = complete_concurrently(stack.addresses["orch"], prompts, max_new_tokens=16, proposer="draft", k=3)
    assert [list(o.token_ids) for o in outs] == refs


def test_the_head_drafts_trees_with_target_onlys_text(eagle3_stack):
    """Token trees from the EAGLE-3 head: each node reads its own output at its parent, the target
    returns both layers' rows for every node and the relay keeps the accepted path's."""
    stack, c, target_dir = eagle3_stack
    stack.start_orchestrator("orch-tree", target_dir, targets=[stack.addresses["target"]],
                             drafts=[stack.addresses["draft"]],
                             extra=("--tree-nodes", "8", "--tree-width", "3", "--rate-per-tenant", "0"))
    tree_rounds = 0
    with Client(stack.addresses["orch-tree"], timeout=120) as t:
        for prompt in PROMPTS:
            want = c.complete(prompt, max_new_tokens=N_NEW, proposer="none")
            out = t.complete(prompt, max_new_tokens=N_NEW, proposer="draft", k=3)
            assert list(out.token_ids) == list(want.token_ids), prompt
            assert not out.stats.fallback_reason and out.stats.cache_misses == 0
            tree_rounds += sum(r.tree for r in out.stats.rounds)
    assert tree_rounds > 0


@pytest.fixture(scope="module")
def speculators_stack(tiny_pair, tmp_path_factory):
    from tests.speculators_reference import written

    target_dir, _ = tiny_pair
    root = tmp_path_factory.mktemp("speculators-head")
    head_dir = written(target_dir, root / "head", "--layer-type", "qwen3", "--norm-before-residual")
    s = Stack(logs=root)
    try:
        t = s.start_service("target", "target", target_dir, register=False, wait=False)
        d = s.start_service("draft", "draft", head_dir, register=False, wait=False,
                            extra=("--base-model", str(target_dir)))
        s.wait_serving("target", "draft")
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d], extra=("--rate-per-tenant", "0"))
        with Client(s.addresses["orch"], timeout=120) as c:
            yield s, c
    finally:
        s.stop()


def test_a_speculators_head_serves_target_onlys_text_alone_and_among_eight(speculators_stack):
    stack, c = speculators_stack
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    refs = [list(c.complete(p, max_new_tokens=16, proposer="none").token_ids) for p in prompts]
    for prompt, ref in zip(prompts[:3], refs):
        out = c.complete(prompt, max_new_tokens=16, proposer="draft", k=3)
        assert list(out.token_ids) == ref and not out.stats.fallback_reason and out.stats.drafted_tokens > 0
    outs = complete_concurrently(stack.addresses["orch"], prompts, max_new_tokens=16, proposer="draft", k=3)
    assert [list(o.token_ids) for o in outs] == refs

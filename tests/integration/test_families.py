"""Targets of the families beyond Llama served by the batched engine, through real processes:
a tiny Qwen3 target drafted by an EAGLE-3 head (features from its sliding-window and q/k-normed
layers), and a tiny Gemma 3 target (local and global layers) drafted by a same-family draft.

Each: 8 concurrent greedy streams each equal that prompt's target-only output alone, and 16
concurrent streams are all admitted (the one-request fallback these families had admitted one).
"""
from __future__ import annotations

import pytest
import torch

from client import Client
from tests.integration.stack import Stack, complete_concurrently

PROMPTS = ["The cat sat on the mat and the dog", "def add(a, b):\n    return a", "Speculative decoding drafts a few"]
WINDOW = 8


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family_stack(request, tmp_path_factory):
    from tests.tiny import build_eagle3_head, build_model

    arch = request.param
    root = tmp_path_factory.mktemp(f"family-{arch}")
    torch.set_num_threads(1)
    target = build_model(root / "target", arch=arch, layers=2, window=WINDOW)
    if arch == "qwen3":
        draft, extra = build_eagle3_head(target, root / "head", layers=(0, 1)), ("--base-model", str(target))
    else:
        draft, extra = build_model(root / "draft", seed=1, perturb_from=target, perturb_std=0.04), ()
    s = Stack(logs=root)
    try:
        t = s.start_service("target", "target", target, register=False, wait=False)
        d = s.start_service("draft", "draft", draft, register=False, wait=False, extra=extra)
        s.wait_serving("target", "draft")
        s.start_orchestrator("orch", target, targets=[t], drafts=[d], extra=("--rate-per-tenant", "0"))
        with Client(s.addresses["orch"], timeout=120) as c:
            yield arch, s, c
    finally:
        s.stop()


def _prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]


def test_eight_concurrent_greedy_streams_each_equal_target_only_alone(family_stack):
    arch, stack, c = family_stack
    prompts = _prompts(8)
    refs = [list(c.complete(p, max_new_tokens=24, proposer="none").token_ids) for p in prompts]
    outs = complete_concurrently(stack.addresses["orch"], prompts, max_new_tokens=24, proposer="draft", k=3)
    assert [list(o.token_ids) for o in outs] == refs, arch
    assert all(not o.stats.fallback_reason for o in outs)
    assert sum(o.stats.drafted_tokens for o in outs) > 0
    assert "batching off" not in (stack.logs / "target.log").read_text()


def test_sixteen_concurrent_streams_are_admitted(family_stack):
    _, stack, _ = family_stack
    outs = complete_concurrently(stack.addresses["orch"], _prompts(16), return_exceptions=True,
                                 max_new_tokens=8, proposer="draft", k=3)
    refused = [o for o in outs if isinstance(o, BaseException)]
    assert not refused, refused[:2]
    assert all(len(o.token_ids) == 8 for o in outs)

"""Chunked prefill: prompts longer than the services' per-request limit give the unchunked text."""
from __future__ import annotations

import pytest

from client import Client
from tests.integration.stack import Stack

LIMIT = 16
PROMPTS = [
    "The cat sat on the mat and the dog sat on the log. A quick brown fox jumps over the lazy "
    "dog while the cat watches. Please rewrite the following sentence: the cat sat on the mat.",
    "def add(a, b):\n    return a + b\nSpeculative decoding drafts a few tokens and the target "
    "verifies them in one pass. The capital of France is Paris. The capital of Italy is Rome.",
]


@pytest.fixture(scope="module")
def pair_of_stacks(tiny_pair, tmp_path_factory):
    """The same models twice: default limit, and --max-request-tokens 16 on both services."""
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("chunked"))
    small = ("--max-request-tokens", str(LIMIT))
    try:
        t = s.start_service("target", "target", target_dir, register=False)
        d = s.start_service("draft", "draft", draft_dir, register=False)
        t16 = s.start_service("target16", "target", target_dir, register=False, extra=small)
        d16 = s.start_service("draft16", "draft", draft_dir, register=False, extra=small)
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d])
        s.start_orchestrator("orch16", target_dir, targets=[t16], drafts=[d16])
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("proposer", ["draft", "none"])
def test_prompts_over_the_request_limit_are_prefilled_in_chunks_with_identical_text(
        pair_of_stacks, proposer):
    s = pair_of_stacks
    with Client(s.addresses["orch"], timeout=120) as full, Client(s.addresses["orch16"], timeout=120) as small:
        for prompt in PROMPTS:
            expected = full.complete(prompt, max_new_tokens=40, proposer=proposer, k=4)
            assert expected.stats.prompt_tokens >= 50
            out = small.complete(prompt, max_new_tokens=40, proposer=proposer, k=4)
            assert out.token_ids == expected.token_ids
            assert out.stats.proposer == proposer and not out.stats.fallback_reason
            # A second turn on the same session: only the new tokens go, chunked again if long.
            follow = prompt + " And once more: " + prompt
            again = small.complete(follow, max_new_tokens=20, proposer=proposer, k=4,
                                   session_id=out.stats.session_id)
            assert again.token_ids == full.complete(follow, max_new_tokens=20, proposer=proposer,
                                                    k=4).token_ids

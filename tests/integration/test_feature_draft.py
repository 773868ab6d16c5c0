"""Feature drafts end to end: an EAGLE-style head in the draft service, features relayed by the orchestrator.

Tiny models, real processes: a tiny target, a tiny feature head made from it
(tests.tiny.build_feature_head: its drafts depend on the target features it is
sent) and an orchestrator. Greedy output is target-only's in every mode
(sequential, parallel, combined with lookup, adaptive k), the features' bytes
are counted per round, sampling follows the target's distribution (chi-square,
with the head's own distribution as the control that must fail), and a draft
that dies or restarts costs speed, never text.
"""
from __future__ import annotations

import time

import pytest
import torch

from client import Client
from tests.integration.stack import Stack
from tests.integration.test_sampling import P_THRESHOLD, PROMPT, TOP_K, chi2_pvalue, first_pairs, joint

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "Speculative decoding drafts a few"]
N_NEW = 24
SEEDS = 1000


@pytest.fixture(scope="module")
def feature_stack(tiny_pair, tmp_path_factory):
    from tests.tiny import build_feature_head

    target_dir, _ = tiny_pair
    root = tmp_path_factory.mktemp("features")
    torch.set_num_threads(1)
    head_dir = build_feature_head(target_dir, root / "head")
    s = Stack(logs=root)
    try:
        t = s.start_service("target", "target", target_dir, register=False, wait=False)
        d = s.start_service("draft", "draft", head_dir, register=False, wait=False)
        s.wait_serving("target")
        s.wait_serving("draft")
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d], extra=("--rate-per-tenant", "0"))
        with Client(s.addresses["orch"], timeout=120) as c:
            yield s, c, target_dir, head_dir
    finally:
        s.stop()


def test_greedy_is_target_only_in_every_mode(feature_stack):
    _, c, _, _ = feature_stack
    drafted = accepted = 0
    for prompt in PROMPTS:
        ref = c.complete(prompt, max_new_tokens=N_NEW, proposer="none")
        for options in (dict(proposer="draft", k=1), dict(proposer="draft", k=3), dict(proposer="draft", k=5),
                        dict(proposer="draft", k=3, parallel=True), dict(proposer="draft", k=5, parallel=True),
                        dict(proposer="combined", k=4), dict(proposer="draft")):
            out = c.complete(prompt, max_new_tokens=N_NEW, **options)
            assert list(out.token_ids) == list(ref.token_ids), (prompt, options)
            assert out.text == ref.text
            s = out.stats
            assert not s.fallback_reason and s.cache_misses == 0, (options, s.fallback_reason)
            assert s.feature_bytes == sum(r.feature_bytes for r in s.rounds) > 0
            assert s.feature_bytes < s.bytes_sent + s.bytes_received  # part of the RPCs' bytes
            if options.get("k"):
                drafted += s.drafted_tokens
                accepted += s.accepted_tokens
    assert 0 < accepted < drafted, "the head must be right often and wrong sometimes"


def test_feature_bytes_per_round(feature_stack):
    """Round 1 carries the prompt's features (the target's prefill); later rounds the rows of
    the tokens sent, fp16 (2 bytes per value), both ways."""
    _, c, target_dir, _ = feature_stack
    from transformers import AutoConfig, AutoTokenizer

    dim = AutoConfig.from_pretrained(target_dir).hidden_size
    prompt_len = len(AutoTokenizer.from_pretrained(target_dir).encode(PROMPTS[0], add_special_tokens=False))
    out = c.complete(PROMPTS[0], max_new_tokens=12, proposer="draft", k=3)
    rounds = out.stats.rounds
    assert rounds[0].drafted == 0  # nothing to draft from before the prompt's features arrive
    assert rounds[0].feature_bytes == prompt_len * dim * 2  # one row per prompt token, in the reply
    for r in rounds[1:]:
        assert r.feature_bytes % (dim * 2) == 0 and r.feature_bytes > 0


def _head_joint(target_dir, head_dir, prompt_ids: list[int]) -> dict[tuple[int, int], float]:
    """The head's own drafting distribution of (d1, d2) at temperature 1 + top-k, computed directly:
    d1 from the target's prompt features, d2 on the head's own predicted feature."""
    from transformers import AutoModelForCausalLM

    from engine.model import drafts, loader

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = loader.load(str(head_dir)).model

    def dist(logits: torch.Tensor) -> dict[int, float]:
        top = torch.topk(logits, TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values.double(), -1).tolist()))

    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        feats = drafts.target_features(target, ids)
        inputs = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)
        hidden = drafts.head_hidden(head, ids, inputs)
        out = {}
        for t1, p1 in dist(head.lm_head(hidden)[0, -1]).items():
            ids2 = torch.tensor([prompt_ids + [t1]])
            h2 = drafts.head_hidden(head, ids2, torch.cat([inputs, hidden[:, -1:]], dim=1))
            for t2, p2 in dist(head.lm_head(h2)[0, -1]).items():
                out[(t1, t2)] = p1 * p2
    return out


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_sampling_follows_the_target(feature_stack, parallel):
    from transformers import AutoTokenizer

    stack, _, target_dir, head_dir = feature_stack
    prompt_ids = AutoTokenizer.from_pretrained(target_dir).encode(PROMPT, add_special_tokens=False)

    def check(seed, out) -> None:
        assert out.stats.proposer == "draft" and not out.stats.fallback_reason

    counts, drafted, accepted = first_pairs(stack.addresses["orch"], SEEDS, check, parallel=parallel)
    rate = accepted / drafted
    assert 0.05 < rate < 0.95, f"the head should be wrong often enough to test rejections ({rate:.2f})"
    p_target = chi2_pvalue(counts, joint(target_dir, prompt_ids), SEEDS)
    p_head = chi2_pvalue(counts, _head_joint(target_dir, head_dir, prompt_ids), SEEDS)
    assert p_target > P_THRESHOLD, f"sampled pairs do not follow the target (p={p_target:.2e}): {counts}"
    assert p_head < P_THRESHOLD, f"no power: the head's own distribution is not rejected (p={p_head:.2e})"


def test_seeded_sampling_is_repeatable_in_each_mode(feature_stack):
    """The same seed gives the same text again. (Unlike a token draft, sequential and parallel
    mode may give different seeded texts: a pre-draft reads the head's own features where a
    sequential Propose reads the target's, so the drafts, and with them which uniforms decide,
    differ; both follow the target's distribution, as the chi-square tests show.)"""
    _, c, _, _ = feature_stack
    for prompt in PROMPTS[:2]:
        for parallel in (False, True):
            options = dict(max_new_tokens=N_NEW, proposer="draft", k=3, temperature=0.8, top_p=0.95, seed=11,
                           parallel=parallel)
            first, again = c.complete(prompt, **options), c.complete(prompt, **options)
            assert list(first.token_ids) == list(again.token_ids), (prompt, parallel)
            assert first.stats.accepted_tokens > 0


def _restart(stack: Stack, name: str, role: str, model) -> None:
    port = int(stack.addresses[name].rsplit(":", 1)[1])
    stack.stop_one(name)
    stack.start_service(name, role, model, register=False, port=port)


def test_multi_turn_and_restarts_keep_the_text(feature_stack):
    stack, c, target_dir, head_dir = feature_stack
    turn1 = [{"role": "user", "content": "Tell me about the cat."}]
    first = c.complete(messages=turn1, max_new_tokens=10, proposer="draft", k=3, keep_session=True)
    sid = first.stats.session_id
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More."}]
    expected2 = c.complete(messages=turn2, max_new_tokens=16, proposer="none")
    second = c.complete(messages=turn2, max_new_tokens=16, proposer="draft", k=3, session_id=sid)
    assert second.token_ids == expected2.token_ids
    assert second.stats.accepted_tokens > 0
    # The turn started with the kept features of the held prefix: the target resent nothing
    # (its first round returns the new message's features; the head drafts from the second).
    assert second.stats.reused_prompt_tokens > 0 and second.stats.cache_misses == 0
    from transformers import AutoConfig

    row = AutoConfig.from_pretrained(target_dir).hidden_size * 2
    assert 0 < second.stats.rounds[0].feature_bytes < second.stats.prompt_tokens * row

    _restart(stack, "draft", "draft", head_dir)  # the head loses its KV: resent from 0, with every feature
    turn3 = turn2 + [{"role": "assistant", "content": second.text}, {"role": "user", "content": "Ok."}]
    expected3 = c.complete(messages=turn3, max_new_tokens=16, proposer="none")
    third = c.complete(messages=turn3, max_new_tokens=16, proposer="draft", k=3, session_id=sid)
    assert third.token_ids == expected3.token_ids
    assert not third.stats.fallback_reason and third.stats.accepted_tokens > 0

    _restart(stack, "target", "target", target_dir)  # the target loses it: its resend returns the features
    fourth = c.complete(messages=turn3, max_new_tokens=16, proposer="draft", k=3)
    assert fourth.token_ids == expected3.token_ids
    assert not fourth.stats.fallback_reason


def test_draft_down_falls_back_to_target_only(feature_stack):
    stack, c, _, head_dir = feature_stack
    expected = c.complete(PROMPTS[1], max_new_tokens=16, proposer="none")
    stack.stop_one("draft")
    try:
        out = c.complete(PROMPTS[1], max_new_tokens=16, proposer="draft", k=4)
        assert out.token_ids == expected.token_ids
        assert out.stats.proposer == "none" and "draft" in out.stats.fallback_reason
    finally:
        stack.start_service("draft", "draft", head_dir, register=False,
                            port=int(stack.addresses["draft"].rsplit(":", 1)[1]))
    deadline = time.monotonic() + 10
    while True:
        again = c.complete(PROMPTS[1], max_new_tokens=16, proposer="draft", k=4)
        assert again.token_ids == expected.token_ids
        if not again.stats.fallback_reason or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert not again.stats.fallback_reason and again.stats.accepted_tokens > 0


def test_the_head_drafts_trees_with_target_onlys_text(feature_stack):
    """An orchestrator with --tree-nodes: the head drafts token trees (each node on its own output
    at its parent), the target verifies them in one pass and returns every node's features, the
    relay keeps the accepted path's. Greedy and seeded sampled text is target-only's; rounds are
    trees that accept past depth 1."""
    stack, _, target_dir, _ = feature_stack
    stack.start_orchestrator("orch-tree", target_dir, targets=[stack.addresses["target"]],
                             drafts=[stack.addresses["draft"]],
                             extra=("--tree-nodes", "10", "--tree-width", "3", "--rate-per-tenant", "0"))
    deep = tree_rounds = 0
    with Client(stack.addresses["orch"], timeout=120) as plain, \
            Client(stack.addresses["orch-tree"], timeout=120) as c:
        for prompt in PROMPTS:
            for sampling in (dict(), dict(temperature=0.8, seed=3)):
                want = plain.complete(prompt, max_new_tokens=N_NEW, proposer="none", **sampling)
                for k in (2, 4):
                    out = c.complete(prompt, max_new_tokens=N_NEW, proposer="draft", k=k, **sampling)
                    assert out.token_ids == want.token_ids, (prompt, sampling, k)
                    s = out.stats
                    assert not s.fallback_reason and s.cache_misses == 0, s.fallback_reason
                    assert s.feature_bytes == sum(r.feature_bytes for r in s.rounds) > 0
                    tree_rounds += sum(r.tree for r in s.rounds)
                    deep += sum(r.tree and r.accepted >= 2 for r in s.rounds)
    assert tree_rounds > 0 and deep > 0, (tree_rounds, deep)

"""Token trees end to end (tiny models, real processes, real Redis, the client library).

An orchestrator started with --tree-nodes drafts a tree each round (draft_service.trees),
the target verifies it in one forward (engine.tree), the accepted path is taken up by both
services on the next call. Greedy output is target-only's, token for token, alone and among
concurrent streams; a seeded sampled request (the coupled sampler) gives target-only's text for
its seed; the rounds are trees (Round.tree) that accept deeper than depth 1 and off the first
candidate (Stats.accepted_by_rank).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from client import Client
from specdec.runtime import procs
from tests.integration.stack import Stack

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "mat is", "A quick brown fox",
           "The capital of France is", "Please rewrite the following"]
N_NEW = 32


@pytest.fixture(scope="module")
def trees(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("trees"))
    try:
        t = s.start_service("target", "target", target_dir, register=False, wait=False)
        d = s.start_service("draft", "draft", draft_dir, register=False, wait=False)
        s.wait_serving("target", "draft")
        s.metrics_port = procs.free_port()
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d],
                             extra=("--tree-nodes", "10", "--tree-width", "3", "--rate-per-tenant", "0",
                                    "--metrics-port", str(s.metrics_port)))
        yield s
    finally:
        s.stop()


def test_tree_greedy_equals_target_only_alone_and_among_streams(trees) -> None:
    with Client(trees.addresses["orch"], timeout=120) as c:
        reference = {p: c.complete(p, max_new_tokens=N_NEW, proposer="none").token_ids for p in PROMPTS}
        rounds = deep = 0
        ranks: list[int] = []
        for p in PROMPTS:
            for k in (2, 4):
                out = c.complete(p, max_new_tokens=N_NEW, proposer="draft", k=k)
                assert out.token_ids == reference[p], (p, k)
                assert not out.stats.fallback_reason and out.stats.cache_misses == 0
                tree_rounds = [r for r in out.stats.rounds if r.tree]
                rounds += len(tree_rounds)
                deep += sum(r.accepted >= 2 for r in tree_rounds)
                ranks = [a + b for a, b in zip(ranks + [0] * 8, list(out.stats.accepted_by_rank) + [0] * 8)]
        assert rounds > 0 and deep > 0, (rounds, deep)
        assert sum(ranks[1:]) > 0, ranks  # trees accept other candidates than the first
    # 16 streams at once, every one target-only's text.
    jobs = (PROMPTS * 3)[:16]

    def run(p: str):
        with Client(trees.addresses["orch"], timeout=120) as c:
            return c.complete(p, max_new_tokens=N_NEW, proposer="draft", k=3).token_ids

    with ThreadPoolExecutor(len(jobs)) as pool:
        assert list(pool.map(run, jobs)) == [reference[p] for p in jobs]


def test_tree_seeded_sampling_is_target_onlys_text_for_the_seed(trees) -> None:
    options = dict(max_new_tokens=N_NEW, temperature=0.8, top_p=0.95)
    with Client(trees.addresses["orch"], timeout=120) as c:
        for p in PROMPTS[:4]:
            for seed in (3, 11):
                want = c.complete(p, seed=seed, proposer="none", **options).token_ids
                for proposer, k in (("draft", 3), ("default", 0)):
                    got = c.complete(p, seed=seed, proposer=proposer, k=k, **options)
                    assert got.token_ids == want, (p, seed, proposer)


def test_tree_sampling_without_a_seed_verifies_trees_by_rejection_over_siblings(trees) -> None:
    """An unseeded sampled request drafts trees too (verify_tree_sampled; its distribution is
    tested in tests/unit/test_tree_sampling.py): tree rounds, accepted paths, no fallback.

    The draws are random (no seed), so only what holds for every draw is asserted: ignore_eos
    makes every request N_NEW tokens long (a CI run sampled an end token after 27 of 32), and
    "some tree round accepted a node" fails only if every round accepts nothing: 156 of 346
    rounds did in five runs (0.45; the count is printed), and 4 x 32 tokens take at least 32
    rounds of at most 4 tokens, so at most 0.55^32 < 1e-8 of runs."""
    with Client(trees.addresses["orch"], timeout=120) as c:
        tree_rounds = accepted = empty = 0
        for p in PROMPTS[:4]:
            out = c.complete(p, max_new_tokens=N_NEW, temperature=0.7, proposer="draft", k=3, ignore_eos=True)
            assert len(out.token_ids) == N_NEW and not out.stats.fallback_reason
            tree_rounds += sum(r.tree for r in out.stats.rounds)
            accepted += sum(r.accepted for r in out.stats.rounds if r.tree)
            empty += sum(r.tree and r.accepted == 0 for r in out.stats.rounds)
    print(f"\nunseeded trees: {tree_rounds} tree rounds, {accepted} accepted, {empty} accepting nothing")
    assert tree_rounds > 0 and accepted > 0, (tree_rounds, accepted)


def test_tree_metrics_count_sizes_depths_and_ranks(trees) -> None:
    """specdec_tree_nodes, specdec_tree_accepted_depth and specdec_tree_accepted_by_rank_total
    move with a tree generation, as its Stats say."""
    import urllib.request

    def scrape() -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{trees.metrics_port}/metrics", timeout=5).read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in body.splitlines()
                                         if line and not line.startswith("#"))}

    before = scrape()
    with Client(trees.addresses["orch"], timeout=120) as c:
        out = c.complete(PROMPTS[0], max_new_tokens=N_NEW, proposer="draft", k=3)
    after = scrape()
    rounds = [r for r in out.stats.rounds if r.tree]
    assert rounds

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("specdec_tree_nodes_count") == len(rounds)
    assert moved("specdec_tree_nodes_sum") == sum(r.drafted for r in rounds)
    assert moved("specdec_tree_accepted_depth_sum") == sum(r.accepted for r in rounds)
    ranks = [rank for r in rounds for rank in r.accepted_ranks]
    assert sum(moved(f'specdec_tree_accepted_by_rank_total{{rank="{k}"}}') for k in set(ranks)) == len(ranks)


def test_lookup_trees_branch_over_several_occurrences_with_target_onlys_text(trees) -> None:
    """Prompt lookup asked for a tree merges what followed several recent occurrences of the last
    n-gram (specdec.core.lookup.propose_tree): greedy output is target-only's, tree rounds happen."""
    prompt = ("the cat sat on the mat. the cat sat on the log. the cat ran to the mat. "
              "the dog sat on the cat. the cat")
    with Client(trees.addresses["orch"], timeout=120) as c:
        want = c.complete(prompt, max_new_tokens=N_NEW, proposer="none").token_ids
        out = c.complete(prompt, max_new_tokens=N_NEW, proposer="lookup", k=4)
        assert out.token_ids == want
        seeded = dict(max_new_tokens=N_NEW, temperature=0.8, seed=5)
        assert (c.complete(prompt, proposer="lookup", k=4, **seeded).token_ids
                == c.complete(prompt, proposer="none", **seeded).token_ids)
    assert any(r.tree for r in out.stats.rounds), [r.drafted for r in out.stats.rounds]


def test_suffix_trees_branch_over_the_contexts_continuations_with_target_onlys_text(trees) -> None:
    """Suffix decoding asked for a tree (k below --tree-nodes) proposes the continuation trie's
    likeliest nodes: "the cat" went on three ways in the prompt. Greedy and seeded output are
    target-only's, and tree rounds happen."""
    prompt = ("the cat sat on the mat. the cat sat on the log. the cat ran to the mat. "
              "the dog sat on the cat. the cat")
    with Client(trees.addresses["orch"], timeout=120) as c:
        want = c.complete(prompt, max_new_tokens=N_NEW, proposer="none").token_ids
        out = c.complete(prompt, max_new_tokens=N_NEW, proposer="suffix", k=4)
        assert out.token_ids == want and out.stats.proposer == "suffix"
        seeded = dict(max_new_tokens=N_NEW, temperature=0.8, seed=5)
        assert (c.complete(prompt, proposer="suffix", k=4, **seeded).token_ids
                == c.complete(prompt, proposer="none", **seeded).token_ids)
    assert any(r.tree for r in out.stats.rounds), [r.drafted for r in out.stats.rounds]


def test_structured_output_drafts_trees_under_a_mask_per_node(trees) -> None:
    """With a grammar the rounds are still trees: the nodes the grammar forbids go with their
    subtrees, the target scores the rest under each node's own mask (TurnMatcher.tree_masks).
    Greedy and seeded output are constrained target-only's and match the grammar; an unseeded
    sampled one matches it too."""
    import json
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "ok": {"type": "boolean"}}, "required": ["name", "ok"],
              "additionalProperties": False}
    pattern = r"(yes|no), [a-z]{2,5}\."
    tree_rounds = 0
    with Client(trees.addresses["orch"], timeout=120) as c:
        for p in PROMPTS[:3]:
            for constraint in (dict(json_schema=schema), dict(regex=pattern)):
                for sampling in (dict(), dict(temperature=0.8, seed=7)):
                    want = c.complete(p, max_new_tokens=48, proposer="none", **constraint, **sampling)
                    for proposer, k in (("draft", 3), ("draft", 5), ("combined", 4)):
                        out = c.complete(p, max_new_tokens=48, proposer=proposer, k=k, **constraint, **sampling)
                        assert out.token_ids == want.token_ids, (p, constraint, sampling, proposer, k)
                        assert not out.stats.fallback_reason and out.stats.cache_misses == 0
                        tree_rounds += sum(r.tree for r in out.stats.rounds)
                    if "regex" in constraint:
                        assert re.fullmatch(pattern, want.text), want.text
                    elif want.stats.finish_reason == "eos":
                        jsonschema.validate(json.loads(want.text), schema)
            free = c.complete(p, max_new_tokens=48, proposer="draft", k=4, temperature=0.9, regex=pattern)
            assert re.fullmatch(pattern, free.text), free.text
            tree_rounds += sum(r.tree for r in free.stats.rounds)
    assert tree_rounds > 0


def test_logprobs_and_min_tokens_ride_on_trees(trees) -> None:
    """Log-probabilities and min_tokens no longer turn trees off: each committed token's
    log-probability (and top alternatives) is target-only's, read from the row it was chosen at;
    min_tokens masks the end tokens at each node by its depth."""
    tree_rounds = 0
    with Client(trees.addresses["orch"], timeout=120) as c:
        for p in PROMPTS[:3]:
            for sampling in (dict(), dict(temperature=0.8, seed=9)):
                want = c.complete(p, max_new_tokens=N_NEW, proposer="none", logprobs=True, top_logprobs=3,
                                  **sampling)
                out = c.complete(p, max_new_tokens=N_NEW, proposer="draft", k=4, logprobs=True, top_logprobs=3,
                                 **sampling)
                assert out.token_ids == want.token_ids, (p, sampling)
                assert len(out.logprobs) == len(want.logprobs) == len(want.token_ids)
                for a, b in zip(out.logprobs, want.logprobs):
                    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, (p, sampling)
                    assert list(a.top_ids) == list(b.top_ids)
                tree_rounds += sum(r.tree for r in out.stats.rounds)
            # A stop token target-only meets at position m - 1: min_tokens = m masks it there (and at
            # every node as deep), so the text goes on as masked target-only's does.
            plain = c.complete(p, max_new_tokens=N_NEW, proposer="none")
            for m in (2, 4, 6, 9):
                stop = plain.token_ids[m - 1]
                want = c.complete(p, max_new_tokens=N_NEW, proposer="none", min_tokens=m, stop_token_ids=[stop])
                out = c.complete(p, max_new_tokens=N_NEW, proposer="draft", k=4, min_tokens=m, stop_token_ids=[stop])
                assert len(want.token_ids) >= m and out.token_ids == want.token_ids, (p, m)
                tree_rounds += sum(r.tree for r in out.stats.rounds)
    assert tree_rounds > 0

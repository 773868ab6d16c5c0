"""Parallel speculation end to end (tiny models, real processes, the client library).

Greedy output in parallel mode is target-only's, token for token, at every k;
a seeded sampled request gives the same text in parallel and sequential mode;
pre-drafted rounds actually happen (Stats.pre_draft_hits).
"""
from __future__ import annotations

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "mat is"]
N_NEW = 32


def test_parallel_greedy_equals_target_only(client) -> None:
    hits = 0
    for prompt in PROMPTS:
        ref = client.complete(prompt, max_new_tokens=N_NEW, proposer="none")
        for k in (1, 2, 3, 4, 6):
            out = client.complete(prompt, max_new_tokens=N_NEW, proposer="draft", k=k, parallel=True)
            assert list(out.token_ids) == list(ref.token_ids), (prompt, k)
            assert out.text == ref.text
            s = out.stats
            assert s.proposer == "draft" and not s.fallback_reason and s.cache_misses == 0
            assert s.pre_draft_hits == sum(r.pre_drafted for r in s.rounds)
            assert s.pre_draft_misses == sum(r.pre_draft_discarded for r in s.rounds)
            assert s.draft_calls == sum(r.k > 0 and not r.pre_drafted for r in s.rounds)
            hits += s.pre_draft_hits
    assert hits > 0


def test_seeded_sampling_same_text_in_both_modes(client) -> None:
    for prompt in PROMPTS:
        for k in (1, 3):
            for seed in (3, 11):
                options = dict(max_new_tokens=N_NEW, proposer="draft", k=k, temperature=0.8, top_p=0.95,
                               seed=seed)
                seq = client.complete(prompt, parallel=False, **options)
                par = client.complete(prompt, parallel=True, **options)
                assert (par.text, list(par.token_ids)) == (seq.text, list(seq.token_ids)), (prompt, k, seed)
                assert list(par.stats.accepted_per_round) == list(seq.stats.accepted_per_round)
                assert seq.stats.pre_draft_hits == seq.stats.pre_draft_misses == 0

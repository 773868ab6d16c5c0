"""Seeded determinism of a whole sampled speculative loop (counter-based randomness end to end)."""
from __future__ import annotations

import torch

from specdec.core.rng import Purpose, uniform
from specdec.core.sampling import SamplingParams, probs_from_logits, sample
from specdec.core.verify import verify_sampled
from tests.unit.test_greedy_equivalence import PROMPTS, TableModel, make_models

torch.set_num_threads(1)
PARAMS = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)


def sampled_loop(target: TableModel, draft: TableModel, prompt: list[int], seed: int, k: int, n: int) -> list[int]:
    """Draft k tokens with DRAFT uniforms, verify with ACCEPT/RESAMPLE uniforms, until n new tokens."""
    seq = list(prompt)
    while len(seq) - len(prompt) < n:
        pos = len(seq)
        drafted, q_rows, ctx = [], [], list(seq)
        for i in range(k):
            q = probs_from_logits(draft.logits(ctx)[None], PARAMS)  # [1, vocab]
            d = int(sample(q, torch.tensor([uniform(seed, pos + i, Purpose.DRAFT)], dtype=torch.float64))[0])
            drafted.append(d)
            q_rows.append(q[0])
            ctx.append(d)
        logits = torch.stack([target.logits(seq + drafted[:j]) for j in range(k + 1)])  # [k + 1, vocab]
        q_t = torch.stack(q_rows) if k else None
        verdict = verify_sampled(drafted, q_t, probs_from_logits(logits, PARAMS), seed=seed, position=pos)
        # A retried round (same seed, same position) makes the same decision.
        assert verify_sampled(drafted, q_t, probs_from_logits(logits, PARAMS), seed=seed, position=pos) == verdict
        seq += verdict.tokens
    return seq[len(prompt) : len(prompt) + n]


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    target, draft = make_models(1)
    prompt = PROMPTS[1]
    for k in (0, 3, 6):
        a = sampled_loop(target, draft, prompt, seed=2024, k=k, n=30)
        b = sampled_loop(target, draft, prompt, seed=2024, k=k, n=30)
        c = sampled_loop(target, draft, prompt, seed=2025, k=k, n=30)
        assert a == b
        assert a != c

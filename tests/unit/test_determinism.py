"""Seeded determinism of the sampled loop (counter-based randomness end to end), through generate()."""
from __future__ import annotations

import torch

from specdec.core.sampling import SamplingParams
from tests.unit.test_loop import PROMPTS, Stack, make_models

torch.set_num_threads(1)
PARAMS = SamplingParams(temperature=1.0, top_k=12, top_p=0.95)


def sampled(k: int, seed: int, restart_at: int | None = None) -> list[int]:
    """30 sampled tokens; optionally both services lose their caches at their `restart_at`-th call."""
    target, draft = make_models(1)
    stack = Stack(target, draft, default_k=k, eos_ids=frozenset())
    for svc in stack.services.values():
        svc.restart_at = restart_at
    out, _, tally = stack.run(PROMPTS[1], k=k, sampling=PARAMS, seed=seed, max_new=30)
    assert restart_at is None or tally.cache_misses >= 1
    return out


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    for k in (0, 3, 6):
        a = sampled(k, seed=2024)
        assert sampled(k, seed=2024) == a
        assert sampled(k, seed=2025) != a


def test_a_round_retried_after_a_cache_miss_draws_the_same_tokens() -> None:
    for k in (0, 3):
        assert sampled(k, seed=7, restart_at=4) == sampled(k, seed=7)

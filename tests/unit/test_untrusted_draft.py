"""A draft the deployment does not trust: what a lying q does to rejection sampling, and why
`--sampler coupled` is immune (docs/security.md, the trust boundary).

Rejection sampling accepts a drafted token d with probability min(1, p(d) / q(d)), q as the
draft reports it. A draft that reports a tiny q for a token it picks has it accepted every time,
so it chooses an unseeded sampled request's output. The coupled sampler never reads q: it
commits the target's own draw for the seed at each position, so the output is target-only
decoding's whatever the draft sends. Greedy requests are immune the same way (the target's argmax).
"""
from __future__ import annotations

import torch

from orchestrator.config import LoopConfig
from specdec.core import rng
from specdec.core.sampling import SamplingParams, coupled_draws
from specdec.core.verify import verify_coupled, verify_sampled

VOCAB, PICKED, POSITION, SEEDS = 8, 7, 10, 4000
P = torch.tensor([0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.04, 0.01])  # the target's p; p(PICKED) = 1%


def _target_rows() -> torch.Tensor:
    return torch.stack([P, P])  # [k + 1, vocab] for one drafted token


def _lying_q() -> torch.Tensor:
    q = torch.full((1, VOCAB), (1 - 1e-6) / (VOCAB - 1))
    q[0, PICKED] = 1e-6  # "I almost never draw this token", about the token it always sends
    return q


def test_a_lying_q_steers_rejection_sampling() -> None:
    """The attack this boundary is for: with the lie, the picked token is committed every time;
    reported truthfully (a deterministic proposal, q one-hot), about p(PICKED) = 1% of the time.
    Truthful: 4000 draws of Bernoulli(0.01) exceed 100 with probability below 1e-15."""
    lied = sum(verify_sampled([PICKED], _lying_q(), _target_rows(), seed=s, position=POSITION).tokens[0] == PICKED
               for s in range(1, SEEDS + 1))
    honest = sum(verify_sampled([PICKED], None, _target_rows(), seed=s, position=POSITION).tokens[0] == PICKED
                 for s in range(1, SEEDS + 1))
    assert lied == SEEDS
    assert honest < 100


def test_the_coupled_sampler_commits_the_targets_draw_whatever_the_draft_claims() -> None:
    """For every seed the committed token is target-only decoding's draw: the drafted token and
    its q never enter (verify_coupled takes no q)."""
    scores = torch.log(_target_rows())
    picked = 0
    for s in range(1, SEEDS + 1):
        keys = [int(k) for k in rng.gumbel_keys(s, [POSITION, POSITION + 1])]
        draws = coupled_draws(scores, keys).tolist()  # the target's draws for this seed
        committed = verify_coupled([PICKED], draws).tokens[0]
        assert committed == draws[0], s  # target-only's token at POSITION for seed s
        picked += committed == PICKED
    assert picked < 100  # about 1%, as the target's p says (below 1e-15 to exceed 100 by chance)


def test_sampler_coupled_couples_every_sampled_request() -> None:
    """`--sampler coupled`: unseeded sampled requests too (the default couples only seeded ones)."""
    sampled = SamplingParams(temperature=0.8)
    assert _config("coupled").couples(sampled, seed=0)
    assert not _config("auto").couples(sampled, seed=0)
    assert _config("auto").couples(sampled, seed=5)


def _config(sampler: str) -> LoopConfig:
    return LoopConfig(store=None, router=None, tokenizer=None, eos_ids=frozenset(), context_length=0,
                      sampler=sampler)

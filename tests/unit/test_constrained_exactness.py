"""Sampling under a grammar mask stays exact: the output has the masked, renormalised target p.

Per trial: a target distribution p and a draft q over a small vocabulary, and
an allowed set (the grammar's mask at this position). The draft samples d ~ q
WITHOUT the mask (the draft service does not know the grammar), the round
sends what `orchestrator.grammar.drafted_to_send` says, and `verify_sampled`
verifies against the masked p. The committed token's distribution over
100,000 trials (fixed seeds) must match masked p by a chi-square test
(p-value > tests.chance.FALSE_ALARM = 1e-6). Control: the tempting shortcut of
cutting a forbidden drafted token and drawing the bonus from masked p
(send_first_invalid=False for a sampled draft) must fail the same test.

Chance: seeds 1..100,000 are fixed, so given the code the outcome is deterministic.
With fresh seeds a correct sampler would fail the one check with probability 1e-6;
the control's statistic is 5,851 against a critical value of 31 (3 degrees of
freedom): it fails at any seed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from orchestrator.common.grammar import drafted_to_send
from specdec.core import rng
from specdec.core.rng import Purpose
from specdec.core.sampling import sample
from specdec.core.verify import verify_sampled_batch
from tests.chance import FALSE_ALARM

torch.set_num_threads(1)

VOCAB = 6
TRIALS = 100_000
P_THRESHOLD = FALSE_ALARM  # per check, for a fresh seed (the seeds here are fixed)


def _setting():
    gen = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.2, -1)
    q = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.2, -1)
    allowed = torch.tensor([True, False, True, True, False, True])
    masked = torch.where(allowed, p, torch.zeros_like(p))
    return masked / masked.sum(), q, allowed


def _committed(send_first_invalid: bool) -> np.ndarray:
    p, q, allowed = _setting()
    seeds = np.arange(1, TRIALS + 1, dtype=np.uint64)
    drafts = sample(q.expand(TRIALS, VOCAB), torch.from_numpy(rng.uniforms(seeds, np.zeros(TRIALS, np.uint64),
                                                                            Purpose.DRAFT)))
    sent = [[int(d)][:drafted_to_send(1 if allowed[d] else 0, 1, send_first_invalid)] for d in drafts]
    verdicts = verify_sampled_batch(sent, [q[None][:len(s)] for s in sent], [p.expand(len(s) + 1, VOCAB) for s in sent],
                                    seeds=[int(x) for x in seeds], positions=[0] * TRIALS)
    return np.array([v.tokens[0] for v in verdicts])


def _pvalue(tokens: np.ndarray) -> float:
    p, _, allowed = _setting()
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[~allowed.numpy()].sum() == 0  # never a forbidden token, either way
    keep = allowed.numpy()
    expected = p.double().numpy()[keep]
    return float(chisquare(counts[keep], expected / expected.sum() * counts.sum()).pvalue)


@pytest.fixture(scope="module")
def exact() -> np.ndarray:
    return _committed(send_first_invalid=True)


def test_masked_rejection_sampling_has_the_masked_distribution(exact) -> None:
    assert _pvalue(exact) > P_THRESHOLD


def test_control_cutting_a_forbidden_sampled_draft_is_caught() -> None:
    assert _pvalue(_committed(send_first_invalid=False)) < P_THRESHOLD


def test_the_cut_rule() -> None:
    assert drafted_to_send(3, 3, True) == 3  # all valid: everything goes
    assert drafted_to_send(1, 4, True) == 2  # sampled: the first forbidden one goes too
    assert drafted_to_send(1, 4, False) == 1  # greedy / deterministic: cut before it
    assert drafted_to_send(0, 0, True) == 0

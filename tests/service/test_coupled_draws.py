"""The coupled sampler (OUTPUT_MODE_COUPLED) on real service processes with the tiny models.

A Score returns the target's coupled draw at each of its k + 1 positions: the
Gumbel-max draw of the reference model's distribution with the noise of
(seed, absolute position), whatever was drafted before it. A Propose drafts
with the same noise. Both return no distributions.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.core import rng
from specdec.core.sampling import SamplingParams, coupled_draws, sampling_logits
from tests.service.conftest import propose, score, temperature

COUPLED = 3  # common_pb2.OUTPUT_MODE_COUPLED
PROMPT = "Please rewrite the following sentence: the cat"
PARAMS = SamplingParams(temperature=0.9, top_k=50)


def _draw(model, ids: list[int], seed: int) -> int:
    """The coupled draw of the token after `ids`, by full recompute."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1:]
    key = int(rng.gumbel_keys(seed, len(ids)))
    return int(coupled_draws(sampling_logits(logits, PARAMS), [key])[0])


def test_score_returns_the_targets_own_draws_whatever_was_drafted(target, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    drafted = [17, 42, 99]  # arbitrary drafts: each position's draw conditions on them
    reply = score(target.stub, "coupled-score", toks + drafted, 0, toks + drafted, k=3,
                  sampling=temperature(0.9, top_k=50), output_mode=COUPLED, seed=77, logprobs=2)
    seq = toks + drafted
    want = [_draw(reference[0], seq[:len(toks) + i], 77) for i in range(4)]
    assert list(reply.sampled_ids) == want
    assert not reply.probs.rows and not reply.probs.dense  # ids only on the wire
    assert len(reply.logprobs.sampled) == 4 and all(v <= 0 for v in reply.logprobs.sampled)
    # Another seed, other draws (with 4 positions at temperature 0.9 they cannot all agree).
    other = score(target.stub, "coupled-score-2", seq, 0, seq, k=3, sampling=temperature(0.9, top_k=50),
                  output_mode=COUPLED, seed=78)
    assert list(other.sampled_ids) == [_draw(reference[0], seq[:len(toks) + i], 78) for i in range(4)]


def test_propose_drafts_with_the_same_noise(draft, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    reply = propose(draft.stub, "coupled-propose", toks, 0, toks, k=5, sampling=temperature(0.9, top_k=50),
                    output_mode=COUPLED, seed=1234)
    assert not reply.probs.rows and not reply.probs.dense
    drafted: list[int] = []
    for _ in range(5):
        drafted.append(_draw(reference[1], toks + drafted, 1234))
    assert list(reply.tokens) == drafted
    assert np.all(np.asarray(reply.tokens) >= 0)

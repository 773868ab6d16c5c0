"""Predicted Outputs and n > 1 over gRPC (real services, real Redis, the client library).

A prediction changes only how many target passes the text costs: greedy, the
text is the one without it; sampled, its distribution. n > 1 choices each have their own
seed; choice 0 is the n = 1 answer.
"""
from __future__ import annotations

import grpc
import pytest

REWRITE = "Please rewrite the following sentence: the cat sat on the mat and purred."
N_NEW = 48


@pytest.fixture(scope="module")
def reference(client):
    return client.complete(REWRITE, max_new_tokens=N_NEW, proposer="none")


def passes_per_token(done) -> float:
    return done.stats.target_passes / done.stats.new_tokens


def test_a_prediction_keeps_the_text_and_realigns_after_a_mismatch(client, reference):
    """The tiny random model writes byte soup, which its own tokenizer does not re-tokenize to the
    same ids, so its decoded text is a prediction with many local mismatches: re-alignment must
    take up the prediction again after each one (the guess proposer stops at the first). The
    cut in target passes with a correct prediction is measured on the real default model
    (tests/integration/test_gateway_api.py)."""
    assert reference.stats.new_tokens == N_NEW
    done = client.complete(REWRITE, max_new_tokens=N_NEW, prediction=reference.text, k=8)
    assert done.token_ids == reference.token_ids and done.text == reference.text
    assert done.stats.proposer == "prediction"
    assert done.stats.rejected_prediction_tokens == done.stats.drafted_tokens - done.stats.accepted_tokens
    assert done.stats.accepted_prediction_tokens == done.stats.accepted_tokens
    guess = client.complete(REWRITE, max_new_tokens=N_NEW, proposer="guess", guess=reference.text, k=8)
    assert guess.token_ids == reference.token_ids
    assert done.stats.accepted_prediction_tokens >= guess.stats.accepted_tokens + 8, (
        done.stats.accepted_tokens, guess.stats.accepted_tokens)
    assert done.stats.target_passes < guess.stats.target_passes <= reference.stats.target_passes


def test_a_wrong_prediction_keeps_the_text_and_sampling_is_seeded(client):
    plain = client.complete(REWRITE, max_new_tokens=24, proposer="none")
    wrong = client.complete(REWRITE, max_new_tokens=24, prediction="the dog sat on the log " * 4)
    assert wrong.token_ids == plain.token_ids
    # Sampled, a prediction is verified by exact rejection sampling (q one-hot): the target's
    # distribution (tests/unit/test_exactness.py), and a function of the seed and the prediction.
    sampled = [client.complete(REWRITE, max_new_tokens=24, temperature=0.9, seed=7,
                               prediction=plain.text, k=4) for _ in range(2)]
    assert sampled[0].token_ids == sampled[1].token_ids
    assert sampled[0].stats.proposer == "prediction"


def test_prediction_with_another_proposer_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.complete(REWRITE, max_new_tokens=4, proposer="draft", prediction="x")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prediction:")


def choices(client, **options):
    stream = client.generate(REWRITE, **options)
    texts: dict[int, list[int]] = {}
    for chunk in stream:
        texts.setdefault(chunk.index, []).extend(chunk.token_ids)
    return texts, stream.choice_stats


def test_n_choices_have_their_own_seeds_and_choice_0_is_the_n1_answer(client):
    options = dict(max_new_tokens=16, temperature=1.0, seed=99, proposer="draft")
    texts, stats = choices(client, n=3, **options)
    assert sorted(texts) == sorted(stats) == [0, 1, 2]
    one = client.complete(REWRITE, **options)
    assert tuple(texts[0]) == one.token_ids
    assert len({tuple(t) for t in texts.values()}) == 3  # independent draws
    assert stats[0].seed == 99 and len({s.seed for s in stats.values()}) == 3
    assert all(stats[i].new_tokens == len(texts[i]) for i in texts)
    again, _ = choices(client, n=3, **options)
    assert again == texts  # counter-based: the same seed gives the same choices


def test_n_greedy_choices_agree(client):
    texts, stats = choices(client, n=2, max_new_tokens=12, proposer="lookup")
    assert texts[0] == texts[1] and stats[1].index == 1
    done = client.complete(REWRITE, n=2, max_new_tokens=12, proposer="lookup")
    assert [c.token_ids for c in done.choices] == [tuple(texts[0]), tuple(texts[1])]
    assert done.token_ids == tuple(texts[0]) and done.choices[1].stats.index == 1


@pytest.mark.parametrize("options", [dict(n=17), dict(n=2, keep_session=True)])
def test_bad_n_is_invalid_argument(client, options):
    with pytest.raises(grpc.RpcError) as err:
        client.complete(REWRITE, max_new_tokens=4, **options)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().split(":")[0] in ("n", "keep_session")


def test_n_choices_share_the_prompts_prefill(client):
    """Choices 1.. start from a fork of choice 0's prefilled prompt on both services: they
    report the prompt as reused (all but its last token) and their texts are those of
    choices prefilling on their own (the same seeds)."""
    options = dict(max_new_tokens=12, temperature=0.8, seed=7, proposer="draft", k=3)
    texts, stats = choices(client, n=3, **options)
    prompt = stats[0].prompt_tokens
    assert stats[0].reused_prompt_tokens == 0
    assert [stats[i].reused_prompt_tokens for i in (1, 2)] == [prompt - 1] * 2
    from specdec.core.rng import choice_seed

    for i in (1, 2):  # the same choice alone (its own prefill) writes the same tokens
        alone = client.complete(REWRITE, **{**options, "seed": choice_seed(7, i)})
        assert tuple(texts[i]) == alone.token_ids and alone.stats.reused_prompt_tokens == 0

"""specdec.distill in-process: prompt set, reduced-vocabulary head, draft folder, training helps."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.distill import data, evaluate, prompts, train
from specdec.hosting import drafts


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-layer target, so a 1-layer draft is a real reduction.

    A smaller weight spread than the default tiny models: still deterministic
    greedy text, but a function of the context smooth enough to learn from a
    few thousand tokens (the default spread makes held-out text look random).
    """
    from tests.tiny import build_model

    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("distill") / "target", seed=3, layers=4, init_std=0.08)


def _load(path: Path):
    from specdec.hosting.loader import load

    return load(str(path))


def test_shipped_prompt_file_is_the_generated_set() -> None:
    shipped = prompts.load()
    built = prompts.build()
    assert [p.to_json() for p in shipped] == [p.to_json() for p in built]
    assert len(shipped) >= 1000
    assert len({p.category for p in shipped}) >= 6
    assert len({p.messages[0]["content"] for p in shipped}) == len(shipped)  # no duplicates
    train_set, heldout = prompts.split(shipped, None, None)
    assert len(heldout) >= 64 and not {p.id for p in train_set} & {p.id for p in heldout}
    # A prefix of the shuffled set is already varied.
    assert len({p.category for p in train_set[:100]}) >= 5


def test_simulated_tokens_per_pass() -> None:
    # Agreement pattern T T F T: k=1 commits [T]+1, then ... by hand:
    # pos0: run 1 (k=1) -> 2 tokens; pos2: F -> 1 token; pos3: T, end -> 1 token: 4 tokens / 3 passes.
    assert evaluate.simulate_tokens_per_pass([[True, True, False, True]], 1) == pytest.approx(4 / 3)
    # k=2: pos0: run 2 -> 3 tokens; pos3: 1 token: 4 / 2.
    assert evaluate.simulate_tokens_per_pass([[True, True, False, True]], 2) == pytest.approx(2.0)
    assert evaluate.simulate_tokens_per_pass([[False] * 5], 4) == 1.0
    assert evaluate.simulate_tokens_per_pass([[True] * 9], 8) == 9.0  # 8 accepted + bonus... capped by length


def test_subset_head_gives_q_zero_outside_its_vocabulary(deep_target: Path) -> None:
    model = _load(deep_target).model
    vocab = model.get_output_embeddings().weight.shape[0]
    subset = torch.tensor(sorted(random.Random(0).sample(range(vocab), 50)))
    drafts.build_from_target(model, 1, subset)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[subset] = False
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[5, 17, 42, 99]])).logits[0]  # [4, vocab]
    assert logits.shape == (4, vocab)
    for params in (SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_p=0.9),
                   SamplingParams(temperature=1.0, top_k=5)):
        q = probs_from_logits(logits, params)  # [4, vocab]
        assert torch.all(q[:, outside] == 0.0), params
        assert torch.allclose(q.sum(-1), torch.ones(4)), params
        assert bool((q[:, subset] > 0).any(-1).all())
    # The subset logits equal the full head's rows for those tokens.
    full = _load(deep_target).model
    drafts.build_from_target(full, 1, None)
    with torch.inference_mode():
        reference = full(input_ids=torch.tensor([[5, 17, 42, 99]])).logits[0]
    torch.testing.assert_close(logits[:, subset], reference[:, subset])


def test_draft_folder_round_trips_through_the_loader(deep_target: Path, tmp_path: Path) -> None:
    from specdec.hosting.loader import load, tokenizer_fingerprint

    target = _load(deep_target)
    model = target.model
    drafts.build_from_target(model, 2, torch.arange(0, 384, 3))
    with torch.no_grad():
        for _, p in drafts.trainable_named(model):
            p.add_(torch.randn_like(p) * 0.1)  # "trained": differs from the target's layers
    manifest = drafts.Manifest(target=str(deep_target), target_name="t", num_layers=2, vocab_subset=128,
                              tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer), dtype="float32")
    folder = drafts.save(model, tmp_path / "d", manifest)
    assert sorted(p.name for p in folder.iterdir()) == ["draft.safetensors", "specdec-draft.json"]
    loaded = load(str(folder))
    assert loaded.num_layers == 2 and loaded.vocab_size == 384
    ids = torch.tensor([[1, 7, 9, 200, 33]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, model(input_ids=ids).logits)
    # A draft whose target changed its tokenizer is refused.
    bad = drafts.Manifest(**{**manifest.__dict__, "tokenizer_fingerprint": "0" * 64})
    bad.write(folder)
    with pytest.raises(ValueError, match="different tokenizer"):
        load(str(folder))


def test_training_raises_held_out_agreement(deep_target: Path, tmp_path: Path) -> None:
    """A 1-layer draft of the 4-layer tiny target: trained must beat untrained clearly."""
    target = _load(deep_target)
    all_prompts = prompts.load()
    train_prompts, heldout_prompts = prompts.split(all_prompts, 320, 24)
    config = data.GenConfig(max_new_tokens=24, batch_size=64, top_k=8, shard_prompts=160)
    data.generate(target.model, target.tokenizer, train_prompts, tmp_path / "train", target.eos_token_ids, config)
    data.generate(target.model, target.tokenizer, heldout_prompts, tmp_path / "heldout", target.eos_token_ids, config)
    records = data.load_records(tmp_path / "train")
    heldout = data.load_records(tmp_path / "heldout")
    assert len(records) == 320 and len(heldout) == 24
    assert len(list((tmp_path / "train").glob("shard-*.pt"))) == 2
    # The stored greedy token is the top-1 of the stored top-k, and teacher forcing reproduces it.
    first = records[0]
    assert first["topk_ids"][:, 0].tolist() == first["response"]
    with torch.inference_mode():
        tf = target.model(input_ids=torch.tensor([first["prompt"] + first["response"]])).logits[0]
    start = len(first["prompt"]) - 1
    assert tf[start:start + len(first["response"])].argmax(-1).tolist() == first["response"]

    untrained = _load(deep_target).model
    drafts.build_from_target(untrained, 1, None)
    before = evaluate.quality(untrained, heldout)["agreement"]
    model = _load(deep_target).model
    drafts.build_from_target(model, 1, None)
    summary = train.train(model, records, train.TrainConfig(steps=100, batch_tokens=512, lr=3e-3, amp="float32",
                                                            ckpt_every=50),
                          tmp_path / "ckpt.pt", pad_id=target.tokenizer.pad_token_id, vocab=384)
    after = evaluate.quality(model, heldout)
    assert summary["steps"] == 100 and (tmp_path / "ckpt.pt").is_file()
    assert after["agreement"] >= before + 0.15, (before, after)
    assert after["tokens_per_pass"][4] > evaluate.quality(untrained, heldout)["tokens_per_pass"][4]


def test_vocabulary_subset_is_the_most_frequent_response_tokens() -> None:
    records = [{"response": [5, 5, 5, 7, 7, 9],
                "topk_ids": torch.tensor([[5, 1], [5, 1], [5, 2], [7, 1], [7, 3], [9, 3]])}]
    assert train.choose_subset(records, 4, 12, always=[11]).tolist() == [5, 7, 9, 11]
    assert train.choose_subset(records, 2, 12, always=[11]).tolist() == [5, 11]  # EOS first, then by count
    # Then the target's runner-up tokens by count (1 and 3 twice, 2 once), then the lowest ids.
    assert train.choose_subset(records, 8, 12, always=[11]).tolist() == [0, 1, 2, 3, 5, 7, 9, 11]

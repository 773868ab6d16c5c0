"""distill.eagle on a tiny target: features, the unrolled passes, training, save -> load, the chain simulation."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distill import data, eagle, prompts
from engine.model import drafts


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """A 4-layer tiny target, its greedy responses to a few prompts, and their teacher-forced features."""
    from tests.tiny import distill_target

    root = tmp_path_factory.mktemp("eagle")
    target_dir, target, train_prompts, heldout_prompts = distill_target(root)
    config = data.GenConfig(max_new_tokens=20, batch_size=48, top_k=4, shard_prompts=48)
    data.generate(target.model, target.tokenizer, train_prompts, root / "train", target.eos_token_ids, config)
    data.generate(target.model, target.tokenizer, heldout_prompts, root / "heldout", target.eos_token_ids, config)
    records, features, summary = eagle.cached_features(target.model, root / "train", root / "features", dtype="float32",
                                                       pad_id=target.tokenizer.pad_token_id, batch_tokens=512)
    return target_dir, target, records, features, summary, root


def _head(target_dir: Path, subset: torch.Tensor | None = None):
    from engine.model.loader import load

    model = load(str(target_dir)).model
    return drafts.build_feature_head(model, 1, subset)


def test_features_are_the_targets_and_are_cached(tiny_run) -> None:
    target_dir, target, records, features, summary, root = tiny_run
    assert summary["records"] == 40 and summary["computed_tokens"] == summary["tokens"] > 0
    r, f = records[0], features[0]
    assert f.dtype == torch.float16 and f.shape == (len(r["prompt"]) + len(r["response"]) - 1, 64)
    with torch.inference_mode():  # batched + padded = one sequence alone
        alone = drafts.target_features(target.model, torch.tensor([r["prompt"] + r["response"][:-1]]))[0]
    torch.testing.assert_close(f.float(), alone, atol=2e-2, rtol=1e-2)
    assert eagle.feature_fidelity(target.model, records, features) >= 0.97
    again = eagle.cached_features(target.model, root / "train", root / "features", dtype="float32",
                                  pad_id=target.tokenizer.pad_token_id)
    assert again[2]["computed_tokens"] == 0 and all(torch.equal(a, b) for a, b in zip(again[1], features))


def test_generation_keeps_the_features_it_computes(tiny_run, tmp_path: Path) -> None:
    """GenConfig.features: each record carries the features of prompt + response[:-1], equal to a teacher-forced
    pass (rows of different lengths, left padding, rows leaving at EOS); the feature stage then computes none."""
    _, target, records, features, _, _ = tiny_run
    train_prompts, _ = prompts.split(prompts.load(), 40, 8)
    config = data.GenConfig(max_new_tokens=20, batch_size=48, top_k=4, shard_prompts=48, features=(-1,))
    data.generate(target.model, target.tokenizer, train_prompts, tmp_path / "train", target.eos_token_ids, config)
    kept = data.load_records(tmp_path / "train")
    assert [r["response"] for r in kept] == [r["response"] for r in records]  # the same greedy text
    assert len({len(r["prompt"]) for r in kept}) > 1
    for r, f in zip(kept, features):
        assert r["features"].dtype == torch.float16 and r["features"].shape == f.shape
        torch.testing.assert_close(r["features"].float(), f.float(), atol=2e-2, rtol=1e-2)
    again, feats, summary = eagle.cached_features(target.model, tmp_path / "train", tmp_path / "features",
                                                  dtype="float32", pad_id=target.tokenizer.pad_token_id)
    assert summary["computed_tokens"] == 0 and summary["from_generation_tokens"] == summary["tokens"]
    assert all("features" not in r for r in again) and all(torch.equal(a["features"], b) for a, b in zip(kept, feats))
    assert eagle.feature_fidelity(target.model, again, feats) == 1.0  # they made the greedy tokens
    # Rows that leave the batch early: a token the responses use, taken as the end of sequence.
    # Both generators: transformers' padded batch, and the engine's with 5 rows in flight for 12 prompts.
    stop = records[0]["response"][3]
    batch = [r["prompt"] for r in records[:12]]
    with torch.inference_mode():
        padded = data.generate_batch(target.model, batch, [stop], max_new_tokens=20, top_k=4,
                                     pad_id=target.tokenizer.pad_token_id, features=(-1,))
        pooled = data.generate_pooled(data.pooled_forward(target.model), batch, [stop], max_new_tokens=20, top_k=4,
                                      rows=5, features=(-1,))
        assert len({len(r["response"]) for r in padded}) > 1
        assert [r["response"] for r in pooled] == [r["response"] for r in padded]
        for a, b in zip(padded, pooled):
            alone = drafts.target_features(target.model, torch.tensor([a["prompt"] + a["response"][:-1]]))[0]
            torch.testing.assert_close(a["features"].float(), alone, atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(b["features"].float(), alone, atol=2e-2, rtol=1e-2)
            assert torch.equal(a["topk_ids"][:, 0], b["topk_ids"][:, 0])
            torch.testing.assert_close(a["topk_logprobs"].float(), b["topk_logprobs"].float(), atol=2e-2, rtol=1e-2)


def test_unrolled_passes_are_what_drafting_computes(tiny_run) -> None:
    """Pass 1 is head_hidden; pass d is the sequential chain's d-th draft (checked from every start)."""
    target_dir, target, records, features, _, _ = tiny_run
    model = _head(target_dir, torch.arange(0, 384, 2))
    gen = torch.Generator().manual_seed(0)  # fixed noise: the run-for-run check below sees the same head
    with torch.no_grad():  # not the identity init, so that the passes differ
        for _, p in drafts.trainable_named(model):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    batch = eagle.collate(records[:3], features[:3], torch.device("cpu"), 0)
    with torch.inference_mode():
        outs = eagle.multi_pass(model, batch["ids"], batch["features"], 3)
        reference = drafts.head_hidden(model, batch["ids"], eagle._shift(batch["features"].float()))
    for b, r in enumerate(records[:3]):
        n = len(r["prompt"]) + len(r["response"]) - 1
        torch.testing.assert_close(outs[0][b, :n], reference[b, :n], atol=1e-4, rtol=1e-4)
    assert (outs[1] - outs[0]).abs().max() > 1e-3
    # Pass 2 at t = one sequential draft step after the committed prefix ending at t - 1.
    r, f = records[0], features[0]
    t = len(r["prompt"]) + 2
    with torch.inference_mode():
        h = drafts.head_hidden(model, torch.tensor([eagle._sequence(r)[:t]]), eagle._shift(f[None, :t].float()))
        x = model.model.fc(torch.cat([model.get_input_embeddings()(torch.tensor([eagle._sequence(r)[:t + 1]])),
                                      torch.cat([eagle._shift(f[None, :t].float()), h[:, -1:]], 1)], -1))
        second = model.model(inputs_embeds=x, use_cache=False).last_hidden_state[0, -1]
    torch.testing.assert_close(outs[1][0, t], second, atol=1e-4, rtol=1e-4)
    check = eagle.chain_check(model, records, features, starts=60, k=4)
    assert check["same_run_fraction"] == 1.0, check


def test_training_lowers_the_loss_and_the_head_round_trips(tiny_run, tmp_path: Path) -> None:
    from engine.model.loader import load, tokenizer_fingerprint
    from distill.train import column_map

    target_dir, target, records, features, _, _ = tiny_run
    model = _head(target_dir)
    config = eagle.EagleConfig(steps=30, batch_tokens=256, lr=3e-3, amp="float32", ckpt_every=15, depth=2)
    cmap = column_map(model, 384, torch.device("cpu"))
    batch = eagle.collate(records[:16], features[:16], torch.device("cpu"), 0)
    with torch.no_grad():
        before = eagle.losses(model, batch, config, cmap)[0].item()
    summary = eagle.train(model, records, features, config, tmp_path / "ckpt.pt", pad_id=0, vocab=384)
    with torch.no_grad():
        after = eagle.losses(model, batch, config, cmap)[0].item()
    assert summary["steps"] == 30 and (tmp_path / "ckpt.pt").is_file()
    assert after < 0.8 * before, (before, after)
    manifest = drafts.Manifest(target=str(target_dir), target_name="t", num_layers=1, vocab_subset=0,
                               tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer), dtype="float32",
                               kind=drafts.EAGLE)
    folder = drafts.save(model, tmp_path / "head", manifest)
    loaded = load(str(folder))
    assert loaded.feature_dim == 64 and loaded.num_layers == 1
    ids, feats = batch["ids"][:2], eagle._shift(batch["features"][:2].float())
    with torch.inference_mode():
        torch.testing.assert_close(drafts.head_hidden(loaded.model, ids, feats), drafts.head_hidden(model, ids, feats))
    quality = eagle.quality(loaded.model, records[:8], features[:8], ks=(1, 2, 4))
    assert quality["tokens_per_pass"][1] <= quality["tokens_per_pass"][4] <= 5
    assert 0 <= quality["agreement"] <= 1 and set(quality["depth_acceptance"]) == {1, 2, 3, 4}


def test_cli_trains_and_evaluates_an_eagle_head(tiny_run, tmp_path: Path) -> None:
    """train/eval --kind eagle through the CLI: an eagle folder the loader serves, numbers in its manifest."""
    import json
    import shutil

    from distill import cli
    from engine.model.loader import load

    target_dir, _, _, _, _, root = tiny_run
    run = tmp_path / "run"
    for name in ("train", "heldout"):
        shutil.copytree(root / name, run / "data" / name)
    (run / "data" / "info.json").write_text(json.dumps({"train": {"prompts": 40}, "heldout": {"prompts": 8}}))
    common = ["--target-model", str(target_dir), "--out", str(run), "--threads", "1", "--heldout-file", "",
              "--kind", "eagle", "--vocab", "128", "--amp", "float32", "--draft-dtype", "float32"]
    assert cli.main(["train", "--steps", "6", "--batch-tokens", "128", "--depth", "3", *common]) == 0
    assert cli.main(["eval", *common]) == 0
    manifest = drafts.Manifest.read(run / "draft")
    assert manifest.kind == drafts.EAGLE and manifest.num_layers == 1 and manifest.vocab_subset == 128
    assert manifest.recipe["train"]["depth"] == 3 and manifest.recipe["features"]["records"] == 40
    assert set(manifest.eval["tokens_per_pass"]) == {str(k) for k in range(1, 9)}
    assert manifest.eval["chain_check"]["same_run_fraction"] == 1.0
    assert load(str(run / "draft")).feature_dim == 64
    result = json.loads((run / "eval.json").read_text())
    assert result["by_set"]["heldout"]["positions"] == sum(len(r["response"]) for r in data.load_records(
        run / "data" / "heldout"))

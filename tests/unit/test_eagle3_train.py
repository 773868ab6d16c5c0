"""distill.eagle3 on a tiny target: the layer streams the data stage keeps, sampled responses, the head's
unrolled passes against the engine's serving forward, training, and the published layout it writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distill import data, eagle, eagle3
from engine.model import eagle3 as eagle3_format
from engine.model import drafts

LAYERS = (0, 2)  # of the tiny 4-layer target: the streams entering its first and third layers


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """A 4-layer tiny target and greedy training data that keeps the streams entering LAYERS."""
    from tests.tiny import distill_target

    root = tmp_path_factory.mktemp("eagle3")
    target_dir, target, train_prompts, heldout_prompts = distill_target(root)
    config = data.GenConfig(max_new_tokens=20, batch_size=16, top_k=4, shard_prompts=48, features=LAYERS)
    data.generate(target.model, target.tokenizer, train_prompts, root / "data" / "train", target.eos_token_ids,
                  config)
    data.generate(target.model, target.tokenizer, heldout_prompts, root / "data" / "heldout",
                  target.eos_token_ids, data.GenConfig(max_new_tokens=20, batch_size=16, top_k=4))
    records, features, summary = eagle.cached_features(target.model, root / "data" / "train", root / "features",
                                                       dtype="float32", pad_id=0, layers=LAYERS)
    return target_dir, target, records, features, summary, root


def test_generation_keeps_the_layer_streams(tiny_run) -> None:
    """The kept features are the streams entering LAYERS side by side, as a teacher-forced pass computes them
    (and as the served target's Score hands them over); the feature stage then computes none."""
    _, target, records, features, summary, _ = tiny_run
    assert summary["computed_tokens"] == 0 and summary["from_generation_tokens"] == summary["tokens"] > 0
    for r, f in list(zip(records, features))[:6]:
        seq = torch.tensor([r["prompt"] + r["response"][:-1]])
        with torch.inference_mode():
            states = target.model.model(input_ids=seq, output_hidden_states=True).hidden_states
            want = torch.cat([states[i][0] for i in LAYERS], dim=-1)
            assert torch.allclose(drafts.target_features(target.model, seq, layers=LAYERS)[0], want)
        assert f.shape == want.shape == (seq.shape[1], 2 * 64)
        torch.testing.assert_close(f.float(), want, atol=2e-2, rtol=1e-2)
    # An EAGLE-1 head's final state is another width: the kept layer streams are not taken for it.
    root = tiny_run[5]
    _, final, other = eagle.cached_features(target.model, root / "data" / "train", root / "final", dtype="float32",
                                            pad_id=0, shards=1, layers=(-1,))
    assert other["computed_tokens"] > 0 and final[0].shape[1] == 64


def test_sampled_responses_are_seeded_and_keep_the_targets_labels(tiny_run) -> None:
    _, target, records, _, _, _ = tiny_run
    batch = [r["prompt"] for r in records[:8]]
    marks = [i % 2 == 1 for i in range(8)]
    forward = data.pooled_forward(target.model)
    with torch.inference_mode():
        greedy = data.generate_pooled(forward, batch, target.eos_token_ids, max_new_tokens=20, top_k=4, rows=4)
        a = data.generate_pooled(forward, batch, target.eos_token_ids, max_new_tokens=20, top_k=4, rows=4,
                                 sampled=marks, seed=7)
        b = data.generate_pooled(forward, batch, target.eos_token_ids, max_new_tokens=20, top_k=4, rows=3,
                                 sampled=marks, seed=7)
    assert [r["response"] for r in a] == [r["response"] for r in b]  # seeded per prompt, whatever the batch
    for g, s, mark in zip(greedy, a, marks):
        assert ("sampled" in s) == mark
        if not mark:
            assert s["response"] == g["response"]
        # Each token is one of the target's top-k there, and topk_ids[:, 0] stays its argmax label.
        assert all(t in ids for t, ids in zip(s["response"], s["topk_ids"].tolist()))
    assert any(s["response"] != g["response"] for s, g in zip(a, greedy) if "sampled" in s)
    sampled_rows = [s for s in a if "sampled" in s]
    assert any(t != ids[0] for s in sampled_rows for t, ids in zip(s["response"], s["topk_ids"].tolist()))


def _head(tiny_run, perturb: float = 0.05):
    target_dir, target, records, *_ = tiny_run
    ids = eagle3.choose_vocab(records, 160, 384, list(target.eos_token_ids))
    head = eagle3.new_head(target, LAYERS, ids)
    if perturb:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # not the init, so that the passes and the halves differ
            for _, p in drafts.trainable_named(head):
                p.add_(torch.randn(p.shape, generator=gen) * perturb)
    return head


def test_unrolled_passes_are_what_the_served_head_computes(tiny_run, tmp_path: Path) -> None:
    """Written in the published layout and loaded as the draft service loads it: pass 1 of the training
    forward equals the loader's reference logits, and pass 2 at t equals the engine's forward drafting one
    token on the head's own output (what the draft service does), token for token over several starts."""
    from engine.model.eagle3 import reference_logits
    from engine.model.llama import LlamaForward
    from engine.model.loader import load
    from engine.plan import LAST, OutputSpec, RowPlan, StepPlan
    from engine.runner import PooledRunner

    target_dir, _, records, features, _, _ = tiny_run
    head = _head(tiny_run)
    folder = eagle3_format.save(head, LAYERS, tmp_path / "head", torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)  # (0, 2): no nested form for 0
    assert config["draft_vocab_size"] == 160 and config["architectures"] == ["LlamaForCausalLMEagle3"]
    served = load(str(folder), base=str(target_dir))
    assert served.feature_kind == "layers:0,2" and served.feature_dim == 128
    model = served.model
    batch = eagle.collate(records[:3], features[:3], torch.device("cpu"), 0)
    with torch.inference_mode():
        trained = eagle.multi_pass(head, batch["ids"], batch["features"], 2)
        loaded = eagle.multi_pass(model, batch["ids"], batch["features"], 2)
    r, f = records[0], features[0]
    seq = eagle._sequence(r)
    n = len(seq)
    with torch.inference_mode():
        ref = reference_logits(model, torch.tensor(seq), eagle._shift(f[None].float())[0])
        for outs in (trained, loaded):
            got = eagle.readout(model, outs[0][0, :n])
            torch.testing.assert_close(got, model.lm_head.subset_logits(model.model.norm(
                outs[0][0, :n])), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.lm_head(model.model.norm(outs[0][0, :n])), ref, atol=2e-4, rtol=1e-4)
    forward = LlamaForward(model)
    runner = PooledRunner(forward, forward.new_pool(8 << 20), fixed_shapes=False, max_rows=2)
    spec = OutputSpec()
    for t in range(len(r["prompt"]), n - 1, 3):
        cache = runner.new_cache()
        cache.reserve(t + 2)
        feed = eagle._shift(f[None, :t + 1].float())[0]
        first = runner.run(StepPlan([RowPlan(cache, seq[:t + 1], 0, 1, spec, features=feed, hidden=LAST)]))[0]
        second = runner.run(StepPlan([RowPlan(cache, [seq[t + 1]], t + 1, 1, spec, features=first.hidden[-1:],
                                              hidden=LAST)]))[0]
        cache.free()
        want = int(model.lm_head.subset[eagle.readout(model, loaded[1][0, t + 1]).argmax()])
        assert second.argmax[0] == want
        torch.testing.assert_close(first.hidden[-1], loaded[0][0, t], atol=2e-3, rtol=1e-3)


def test_training_lowers_the_loss(tiny_run, tmp_path: Path) -> None:
    from distill.train import column_map

    _, _, records, features, _, _ = tiny_run
    head = _head(tiny_run, perturb=0.0)
    config = eagle.EagleConfig(steps=30, batch_tokens=256, lr=3e-3, amp="float32", ckpt_every=15, depth=3,
                               hard_weight=0.5, feature_weight=0.0)
    cmap = column_map(head, 384, torch.device("cpu"))
    batch = eagle.collate(records[:16], features[:16], torch.device("cpu"), 0)
    assert batch["topk_ids"].shape[0] == batch["rows"].shape[0]
    with torch.no_grad():
        before, passes = eagle.losses(head, batch, config, cmap)
    assert len(passes) == 3 and all(p["ce"] >= -1e-4 for p in passes)  # a KL
    rows_before = head.lm_head.sub_weight.detach().clone()
    summary = eagle.train(head, records, features, config, tmp_path / "ckpt.pt", pad_id=0, vocab=384)
    with torch.no_grad():
        after, passes_after = eagle.losses(head, batch, config, cmap)
    assert summary["steps"] == 30 and after.item() < 0.8 * before.item(), (before.item(), after.item())
    assert passes_after[0]["agreement"] > passes[0]["agreement"]
    assert not torch.equal(rows_before, head.lm_head.sub_weight)  # the head's own rows train
    assert head.model.embed_tokens.weight.requires_grad is False


def test_vocabulary_is_chosen_from_the_data(tiny_run) -> None:
    _, target, records, _, _, _ = tiny_run
    ids = eagle3.choose_vocab(records, 100, 384, [383])
    assert ids.numel() == 100 and 383 in ids.tolist() and torch.equal(ids, ids.sort().values)
    counts = torch.bincount(torch.tensor([t for r in records for t in r["response"]]), minlength=384)
    assert int(counts[ids].sum()) > 0.9 * int(counts.sum())  # the frequent responses' tokens are in
    curve = eagle3.coverage_curve(records, {"train": records}, 384, [383], sizes=(50, 100, 200))
    assert curve[50]["train"] <= curve[100]["train"] <= curve[200]["train"] <= 1.0


def test_cli_trains_and_evaluates_an_eagle3_head(tiny_run, tmp_path: Path) -> None:
    """train/eval --kind eagle3 through the CLI: a published-layout folder the loader serves, numbers in
    eval.json."""
    import shutil

    from distill import cli
    from engine.model.loader import load

    target_dir, _, _, _, _, root = tiny_run
    run = tmp_path / "run"
    shutil.copytree(root / "data", run / "data")
    (run / "data" / "info.json").write_text(json.dumps({"train": {"prompts": 40}, "heldout": {"prompts": 8}}))
    common = ["--target-model", str(target_dir), "--out", str(run), "--threads", "1", "--heldout-file", "",
              "--kind", "eagle3", "--aux-layers", "0,2", "--vocab", "128", "--amp", "float32",
              "--draft-dtype", "float32"]
    assert cli.main(["train", "--steps", "6", "--batch-tokens", "128", "--depth", "3", *common]) == 0
    assert cli.main(["eval", *common]) == 0
    config = json.loads((run / "draft" / "config.json").read_text())
    assert config["draft_vocab_size"] == 128 and config["specdec_recipe"]["train"]["depth"] == 3
    loaded = load(str(run / "draft"), base=str(target_dir))
    assert loaded.feature_kind == "layers:0,2"
    result = json.loads((run / "eval.json").read_text())
    assert set(result["by_set"]["heldout"]["tokens_per_pass"]) == {str(k) for k in range(1, 9)}
    assert result["by_set"]["heldout"]["positions"] == sum(len(r["response"]) for r in data.load_records(
        run / "data" / "heldout"))
    # Resumed on other data, the run keeps the vocabulary its checkpoint's head rows belong to.
    first = loaded.model.lm_head.subset.clone()
    assert torch.equal(torch.load(run / "train" / eagle3.VOCAB_FILE), first)
    shard = next((run / "data" / "train").glob("shard-*.pt"))
    fewer = torch.load(shard, weights_only=True)[:12]
    torch.save(fewer, shard)
    assert not torch.equal(eagle3.choose_vocab(fewer, 128, 384, list(loaded.eos_token_ids)), first)
    assert cli.main(["train", "--steps", "8", "--batch-tokens", "128", "--depth", "3", *common]) == 0
    assert torch.equal(load(str(run / "draft"), base=str(target_dir)).model.lm_head.subset, first)
    with pytest.raises(SystemExit, match="128-token draft vocabulary"):
        eagle3.resumed_vocab(run / "train", 256)

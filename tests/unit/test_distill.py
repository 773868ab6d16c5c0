"""distill in-process: prompt set, reduced-vocabulary head, draft folder, training helps."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from specdec.core.sampling import SamplingParams, probs_from_logits
from distill import data, evaluate, heldout, prompts, train
from engine.model import drafts


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
    from engine.model.loader import load

    return load(str(path))


NEW_ROUTES = ("self-instruct", "multi-turn", "quoted-text", "quoted-code")


def _user_turns(prompt_list: list[prompts.Prompt]) -> list[str]:
    return [m["content"] for p in prompt_list for m in p.messages if m["role"] == "user"]


def _word_runs(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_shipped_prompt_file_is_the_generated_set() -> None:
    shipped = prompts.load()
    built = prompts.build()
    assert [p.to_json() for p in shipped] == [p.to_json() for p in built]
    assert len(shipped) >= 1000
    assert len({p.category for p in shipped}) >= 10
    assert len({prompts.message_key(p.messages) for p in shipped}) == len(shipped)  # no duplicates
    assert len({p.id for p in shipped}) == len(shipped)
    train_set, heldout = prompts.split(shipped, None, None)
    assert len(heldout) >= 64 and not {p.id for p in train_set} & {p.id for p in heldout}
    # A prefix of the shuffled set is already varied.
    assert len({p.category for p in train_set[:100]}) >= 5


def test_templated_route_and_its_heldout_set_are_unchanged() -> None:
    """The templated held-out prompts keep their ids and order, so drafts stay comparable on them."""
    shipped = prompts.load()
    templated = prompts.templated()
    assert len(templated) == 8003
    by_id = {p.id: p for p in shipped}
    assert all(by_id[p.id].to_json() == p.to_json() for p in templated)
    assert prompts.split(shipped, None, 64)[1] == prompts.split(templated, None, 64)[1]
    assert not any(p.heldout for p in shipped if p.id >= len(templated))  # new routes only train


def test_new_routes_are_a_substantial_share_of_every_prefix() -> None:
    train_set, _ = prompts.split(prompts.load(), None, None)
    rows = prompts.load_generated()
    assert len(prompts.self_instruct_questions(rows)) >= 300 and len(prompts.answered(rows)) >= 100
    for n, least in ((500, 0.45), (2000, 0.45), (4000, 0.4)):  # a data budget takes a prefix
        share = sum(p.category in NEW_ROUTES for p in train_set[:n]) / n
        assert share >= least, (n, share)
    counts = {route: sum(p.category == route for p in train_set) for route in NEW_ROUTES}
    assert min(counts.values()) >= 100, counts
    multi = [p for p in train_set if p.category == "multi-turn"]
    assert all([m["role"] for m in p.messages] == ["user", "assistant", "user"] for p in multi)
    assert all(m["content"].strip() for p in multi for m in p.messages)


def test_self_instruct_cleaning() -> None:
    assert prompts.clean_question('How do volcanoes form?"\n\nThis question is about') == "How do volcanoes form?"
    assert prompts.clean_question("What is the best way to learn chess openings?") == \
        "What is the best way to learn chess openings?"
    assert prompts.clean_question("I'm ready to help. What's the user's question?\"") is None
    assert prompts.clean_question('Why?"') is None  # too short
    assert prompts.clean_question("In a world where cats rule, a cat named Luna stared") is None  # never closed
    rows = [{"kind": "question", "raw": 'What is DNA made of?"'}, {"kind": "question", "raw": 'what is DNA made of?"'},
            {"kind": "question", "raw": "nothing usable"}]
    assert prompts.self_instruct_questions(rows) == ["What is DNA made of?"]
    # An answer cut by the token cap keeps its complete sentences only.
    assert prompts.trim_answer("Bees make honey from nectar. They store it in wax cells. Then th", False) == \
        "Bees make honey from nectar. They store it in wax cells."
    assert prompts.trim_answer("Too short.", True) is None
    assert prompts.interleave([1, 2, 3, 4], ["a", "b"]) == [1, "a", 2, "b", 3, 4]


def test_heldout_v2_is_built_separately() -> None:
    """Hand-written, checked in, all held out, and sharing no wording with training or the benchmark."""
    shipped = heldout.load_v2()
    built = heldout.build()
    assert [p.to_json() for p in shipped] == [p.to_json() for p in built]
    assert heldout.HELDOUT_V2_FILE.read_text(encoding="utf-8") == "".join(p.to_json() + "\n" for p in built)
    assert 60 <= len(shipped) <= 80 and all(p.heldout for p in shipped)
    assert len({p.category for p in shipped}) >= 8
    assert sum(len(p.messages) == 3 for p in shipped) >= 8  # multi-turn follow-ups
    train_turns = _user_turns(prompts.load())
    assert not set(_user_turns(shipped)) & set(train_turns)
    runs: set[tuple[str, ...]] = set()
    for text in train_turns:
        runs |= _word_runs(text, 7)
    shared = {run for text in _user_turns(shipped) for run in _word_runs(text, 7) & runs}
    assert not shared, shared
    suite = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "suite-v1.jsonl"
    bench = [m["content"] for line in suite.read_text(encoding="utf-8").splitlines() if line.strip()
             for m in json.loads(line)["messages"] if m["role"] == "user"]
    assert len(bench) >= 40
    bench_runs = set().union(*(_word_runs(t, 7) for t in bench))
    assert not {run for text in _user_turns(shipped) for run in _word_runs(text, 7) & bench_runs}
    # The new training routes do not quote the benchmark's inputs either.
    new_turns = _user_turns([p for p in prompts.load() if p.category in NEW_ROUTES])
    assert not {run for text in new_turns for run in _word_runs(text, 7) & bench_runs}


def test_multi_turn_prompt_encodes_every_turn(deep_target: Path) -> None:
    tokenizer = _load(deep_target).tokenizer
    conversation = heldout.build()[[p.category for p in heldout.build()].index("multi-turn")]
    ids = data.encode_prompt(tokenizer, conversation)
    text = tokenizer.decode(ids)
    positions = [text.index(m["content"]) for m in conversation.messages]
    assert positions == sorted(positions)  # every turn, in order
    single = data.encode_prompt(tokenizer, prompts.Prompt(0, "", conversation.messages[:1], False))
    assert len(ids) > len(single) + 10


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
    from engine.model.loader import load, tokenizer_fingerprint

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


def test_cli_evaluates_both_heldout_sets_and_another_draft(deep_target: Path, tmp_path: Path) -> None:
    """data -> train -> eval through the CLI: both held-out sets reported; --draft-model leaves its folder alone."""
    import shutil

    from distill import cli

    v2 = tmp_path / "v2.jsonl"
    v2.write_text("".join(p.to_json() + "\n" for p in heldout.build()[::11]), encoding="utf-8")
    run = tmp_path / "run"
    common = ["--target-model", str(deep_target), "--out", str(run), "--threads", "1", "--heldout-file", str(v2),
              "--max-new-tokens", "8", "--top-k", "4", "--vocab", "0", "--layers", "1"]
    assert cli.main(["data", "--prompts", "24", "--heldout", "4", "--gen-batch", "16", "--shard-prompts", "12",
                     *common]) == 0
    info = json.loads((run / "data" / "info.json").read_text())
    assert (info["train"]["prompts"], info["heldout"]["prompts"], info["heldout_v2"]["prompts"]) == (24, 4, 6)
    assert sum(info["train"]["categories"].values()) == 24 and "?" not in info["train"]["categories"]
    assert cli.main(["train", "--steps", "4", "--batch-tokens", "64", "--amp", "float32", *common]) == 0
    assert cli.main(["eval", *common]) == 0
    result = json.loads((run / "eval.json").read_text())
    by_set = result["draft"]["by_set"]
    assert set(by_set) == {"heldout", "heldout_v2"} and result["sets"]["heldout_v2"]["prompts"] == 6
    assert by_set["heldout"]["agreement"] == result["draft"]["agreement"]
    assert by_set["heldout_v2"]["positions"] == sum(len(r["response"]) for r in data.load_records(
        run / "data" / "heldout_v2"))
    manifest = json.loads((run / "draft" / "specdec-draft.json").read_text())
    assert manifest["eval"]["heldout_v2"]["agreement"] == by_set["heldout_v2"]["agreement"]
    assert manifest["recipe"]["data"]["heldout_v2"]["prompts"] == 6
    # Another draft folder on the same held-out data: same numbers, its manifest untouched.
    other = Path(shutil.copytree(run / "draft", tmp_path / "other"))
    before = (other / "specdec-draft.json").read_text()
    assert cli.main(["eval", "--draft-model", str(other), *common]) == 0
    again = json.loads((run / "eval-other.json").read_text())
    assert again["draft"]["by_set"]["heldout_v2"]["agreement"] == by_set["heldout_v2"]["agreement"]
    assert (other / "specdec-draft.json").read_text() == before
    # The card shows both sets and the side-by-side with the other draft.
    from distill import card

    page = card.render(run, "d", "licence", run / "eval-other.json", "old draft")
    assert "separate held-out v2 (hand-written)" in page and "old draft: agreement" in page
    assert f"{100 * by_set['heldout_v2']['agreement']:.1f}%" in page
    # Continued distillation: --init-draft starts from that draft's tensors (0 steps: they come out as they went in).
    from safetensors.torch import load_file

    again_run = tmp_path / "again"
    shutil.copytree(run / "data", again_run / "data")
    assert cli.main(["train", "--steps", "0", "--init-draft", str(run / "draft"), "--draft-dtype", "float32",
                     *common[:2], "--out", str(again_run), *common[4:]]) == 0
    first, second = load_file(str(run / "draft" / "draft.safetensors")), load_file(
        str(again_run / "draft" / "draft.safetensors"))
    assert set(first) == set(second)
    for name in first:
        torch.testing.assert_close(second[name], first[name].float(), rtol=0, atol=0)
    recipe = json.loads((again_run / "draft" / "specdec-draft.json").read_text())["recipe"]
    assert recipe["init"]["from_draft"] == str(run / "draft")

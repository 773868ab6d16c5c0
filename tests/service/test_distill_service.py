"""`python -m distill` end to end on a tiny target, then the draft service serves the result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.v1 import common_pb2
from specdec.runtime.wire import decode_probs
from tests.service.conftest import ROOT, propose, temperature

PROBS = common_pb2.OUTPUT_MODE_PROBS


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, OUT) after `python -m distill all` with tiny settings."""
    from tests.tiny import build_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill-cli")
    target = build_model(root / "target", seed=3, layers=4, init_std=0.08)
    out = root / "out"
    argv = [sys.executable, "-m", "distill", "all", "--target-model", str(target), "--out", str(out),
            "--prompts", "96", "--heldout", "8", "--max-new-tokens", "16", "--gen-batch", "32", "--shard-prompts", "64",
            "--gen-dtype", "float32", "--layers", "1", "--vocab", "200", "--steps", "20",
            "--batch-tokens", "256", "--lr", "3e-3", "--amp", "float32", "--draft-dtype", "float32",
            "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return target, out


def test_pipeline_writes_data_draft_and_eval(distilled: tuple[Path, Path]) -> None:
    target, out = distilled
    assert len(list((out / "data" / "train").glob("shard-*.pt"))) == 2  # 96 prompts, 64 per shard
    assert (out / "train" / "checkpoint.pt").is_file()
    assert sorted(p.name for p in (out / "draft").iterdir()) == ["draft.safetensors", "specdec-draft.json"]
    manifest = json.loads((out / "draft" / "specdec-draft.json").read_text())
    assert manifest["target"] == str(target.resolve()) and manifest["num_layers"] == 1
    assert manifest["vocab_subset"] == 200 and manifest["eval"]["agreement"] > 0
    result = json.loads((out / "eval.json").read_text())
    for name in ("draft", "stand_in"):
        tpp = result[name]["tokens_per_pass"]
        assert sorted(int(k) for k in tpp) == list(range(1, 9))
        assert all(1.0 <= tpp[str(k)] <= k + 1 for k in range(1, 9))
        assert result[name]["cost"]["c"] > 0
    assert 0 < result["vocab_coverage"]["heldout"] <= 1
    # The data stage is resumable: a rerun finds every shard and generates nothing.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    before = {p: p.stat().st_mtime_ns for p in (out / "data").rglob("shard-*.pt")}
    again = subprocess.run([sys.executable, "-m", "distill", "data", "--target-model", str(target),
                            "--out", str(out), "--prompts", "96", "--heldout", "8", "--max-new-tokens", "16", "--shard-prompts", "64",
                            "--gen-dtype", "float32", "--threads", "1"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in (out / "data").rglob("shard-*.pt")} == before


def test_draft_service_serves_the_distilled_folder(services, distilled: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    from engine.model.loader import load

    target, out = distilled
    svc = services("draft", out / "draft", "--max-draft", "8")  # the deprecated alias of --max-k
    tokenizer = AutoTokenizer.from_pretrained(target)
    toks = tokenizer.apply_chat_template([{"role": "user", "content": "Explain rainbows."}],
                                         add_generation_prompt=True, tokenize=True)
    toks = list(toks["input_ids"] if hasattr(toks, "keys") else toks)
    reply = propose(svc.stub, "distilled", toks, 0, toks, k=5, output_mode=PROBS)
    # The same folder loaded in this process drafts the same greedy tokens.
    model = load(str(out / "draft")).model
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(5):
            expected.append(int(model(input_ids=torch.tensor([toks + expected])).logits[0, -1].argmax()))
    assert list(reply.tokens) == expected
    # Sampled q rows are full-vocabulary and exactly zero outside the draft's 200-token head.
    sampled = propose(svc.stub, "distilled-sampled", toks, 0, toks, k=4, output_mode=PROBS,
                      sampling=temperature(1.0), seed=7)
    q = decode_probs(sampled.probs)  # [k, vocab]
    assert q.shape[1] == 384
    assert ((q > 0).sum(-1) <= 200).all() and ((q > 0).sum(-1) > 1).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]), atol=1e-5, rtol=0)
    subset = model.get_output_embeddings().subset
    outside = torch.ones(384, dtype=torch.bool)
    outside[subset] = False
    assert torch.all(q[:, outside] == 0.0)
    assert set(sampled.tokens) <= set(subset.tolist())


"""The committed default draft (specdec/drafts/smollm2-135m) served by a draft service started without --model."""
from __future__ import annotations

import pytest
import torch

from specdec.v1 import common_pb2
from tests.service.conftest import propose


@pytest.mark.slow
def test_draft_service_default_is_the_committed_distilled_draft(services) -> None:
    """No --model: the draft service serves specdec/drafts/smollm2-135m, which beats the early-exit stand-in."""
    from transformers import AutoTokenizer

    from distill import data, evaluate, prompts
    from draft_service.role import DEFAULT_DRAFT
    from engine.model.loader import load

    assert (DEFAULT_DRAFT / "specdec-draft.json").is_file(), "the default draft is not committed"
    svc = services("draft", None, timeout=600)
    info = svc.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.model_name.startswith("smollm2-135m:distilled") and info.vocab_size == 49152
    target = load(None)
    tokenizer = AutoTokenizer.from_pretrained(target.path)
    _, heldout = prompts.split(prompts.load(), 0, 4)
    encoded = [data.encode_prompt(tokenizer, p) for p in heldout]
    reply = propose(svc.stub, "default", encoded[0], 0, encoded[0], k=4)
    served = load(str(DEFAULT_DRAFT), dtype=None).model  # the same folder, the same dtype choice
    expected: list[int] = []
    with torch.inference_mode():
        for _ in range(4):
            expected.append(int(served(input_ids=torch.tensor([encoded[0] + expected])).logits[0, -1].argmax()))
    assert list(reply.tokens) == expected
    # Held-out agreement with the target's own greedy text, against the early-exit stand-in.
    records = data.generate_batch(target.model, encoded, target.eos_token_ids, max_new_tokens=48, top_k=1,
                                  pad_id=tokenizer.pad_token_id)
    trained = evaluate.quality(served, records)["agreement"]
    stand_in = evaluate.quality(load(None, num_layers=2).model, records)["agreement"]
    assert trained >= 0.3 and trained > stand_in + 0.2, (trained, stand_in)

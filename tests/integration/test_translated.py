"""A draft with another tokenizer, end to end (tiny models, real processes, real Redis).

The draft (tests.tiny.build_permuted_draft) reads text as the target does but numbers its
pieces differently: another tokenizer fingerprint, no id in common. An orchestrator refuses the
pair at start-up unless given --draft-tokenizer, saying so; with it, the drafts are re-encoded
in the target's vocabulary (GetServedModel.draft_mode "text"), accepted, and the output is
target-only's: greedy token for token, seeded sampling for the seed.
"""
from __future__ import annotations

import grpc
import pytest

from client import Client
from specdec.runtime import procs
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import Stack

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "A quick brown fox",
           "The capital of France is", "Please rewrite the following"]
N_NEW = 32


@pytest.fixture(scope="module")
def other_vocab(tiny_pair, tmp_path_factory):
    from tests.tiny import build_permuted_draft

    target_dir, _ = tiny_pair
    draft_dir = build_permuted_draft(target_dir, tmp_path_factory.mktemp("permuted") / "draft")
    s = Stack(logs=tmp_path_factory.mktemp("translated"))
    try:
        t = s.start_service("target", "target", target_dir, register=False, wait=False)
        d = s.start_service("draft", "draft", draft_dir, register=False, wait=False)
        s.wait_serving("target", "draft")
        with pytest.raises(procs.ServiceDied) as refused:
            s.start_orchestrator("refused", target_dir, targets=[t], drafts=[d])
        s.refused = str(refused.value)
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d],
                             extra=("--draft-tokenizer", str(draft_dir), "--rate-per-tenant", "0"))
        yield s
    finally:
        s.stop()


def test_a_pair_without_its_tokenizers_is_refused_naming_the_flag(other_vocab) -> None:
    assert "do not share a vocabulary" in other_vocab.refused
    assert "--draft-tokenizer" in other_vocab.refused
    with grpc.insecure_channel(other_vocab.addresses["orch"]) as channel:
        served = orchestrator_pb2_grpc.OrchestratorStub(channel).GetServedModel(
            orchestrator_pb2.GetServedModelRequest(), timeout=10)
    assert served.draft_mode == "text"


def test_translated_drafts_are_accepted_and_the_text_is_target_onlys(other_vocab) -> None:
    accepted = passes = tokens = 0
    with Client(other_vocab.addresses["orch"], timeout=120) as c:
        for p in PROMPTS:
            want = c.complete(p, max_new_tokens=N_NEW, proposer="none").token_ids
            for proposer, k in (("draft", 3), ("default", 0)):
                out = c.complete(p, max_new_tokens=N_NEW, proposer=proposer, k=k)
                assert out.token_ids == want, (p, proposer, k)
                assert not out.stats.fallback_reason
                if proposer == "draft":
                    accepted += out.stats.accepted_tokens
                    passes += out.stats.target_passes
                    tokens += len(out.token_ids)
            for seed in (3, 11):
                options = dict(max_new_tokens=N_NEW, temperature=0.8, seed=seed)
                want = c.complete(p, proposer="none", **options).token_ids
                assert c.complete(p, proposer="draft", k=3, **options).token_ids == want, (p, seed)
    # The draft reads the target's text with other ids: its drafts, re-encoded, are accepted.
    # Few, with random tiny models: they write many lone bytes of broken UTF-8, which no text
    # carries from one vocabulary to the other (tests/unit/test_translated.py measures the rate
    # on text; benchmarks.features.translated on real models).
    assert accepted > 0 and passes < tokens, (accepted, passes, tokens)

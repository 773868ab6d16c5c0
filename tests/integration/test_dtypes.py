"""Exact in the dtypes users serve, end to end: services in bfloat16 and float16, real processes.

Greedy output of every proposer, of token trees and of a feature head (EAGLE-3) equals target-only
decoding through the same services in the same dtype, alone and among concurrent streams; a seeded
sampled request gives target-only's text for its seed. The tiny models' argmaxes rarely sit on a
near tie, so the bit-level controls live in tests/unit/test_dtypes.py (a planted kernel fails the
start-up check and the target refuses to start, checked here through a real process too); the
embedded SmolLM2 in bfloat16, whose 49k-token vocabulary ties often, is the end-to-end control:
before every position was computed as a decode step is, 6 of 12 prompts diverged there.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from client import Client
from engine.model.dtypes import auto
from specdec.runtime import procs
from specdec.runtime.launch import service_argv
from specdec.v1 import common_pb2, model_pb2_grpc
from tests.integration.stack import ENV, Stack

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "mat is", "A quick brown fox",
           "The capital of France is", "Please rewrite the following"]
N_NEW = 32
MODES = (dict(proposer="draft", k=2), dict(proposer="draft", k=4), dict(proposer="lookup", k=6),
         dict(proposer="combined", k=4), dict(proposer="draft", k=3, parallel=True), dict())


def _stack(tiny_pair, root, dtype: str, *, head: bool = False):
    target_dir, draft_dir = tiny_pair
    s = Stack(logs=root)
    extra = ("--dtype", dtype)
    t = s.start_service("target", "target", target_dir, register=False, wait=False, extra=extra)
    if head:
        from tests.tiny import build_eagle3_head

        draft_dir = build_eagle3_head(target_dir, root / "head", layers=(0, 1))
        extra = extra + ("--base-model", str(target_dir))
    d = s.start_service("draft", "draft", draft_dir, register=False, wait=False, extra=extra)
    s.wait_serving("target", "draft")
    s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d], extra=("--rate-per-tenant", "0"))
    s.start_orchestrator("trees", target_dir, targets=[t], drafts=[d],
                         extra=("--rate-per-tenant", "0", "--tree-nodes", "10", "--tree-width", "3"))
    return s


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def stack(request, tiny_pair, tmp_path_factory):
    s = _stack(tiny_pair, tmp_path_factory.mktemp(request.param), request.param)
    try:
        yield s, request.param
    finally:
        s.stop()


def _info(address: str):
    with grpc.insecure_channel(address) as channel:
        return model_pb2_grpc.TargetServiceStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)


def test_greedy_of_every_proposer_and_of_trees_is_target_only_in_the_dtype(stack) -> None:
    s, dtype = stack
    assert _info(s.addresses["target"]).dtype == dtype
    tree_rounds = 0
    with Client(s.addresses["orch"], timeout=120) as c, Client(s.addresses["trees"], timeout=120) as trees:
        for p in PROMPTS:
            reference = c.complete(p, max_new_tokens=N_NEW, proposer="none").token_ids
            for options in MODES:
                out = c.complete(p, max_new_tokens=N_NEW, **options)
                assert out.token_ids == reference, (dtype, p, options)
                assert not out.stats.fallback_reason and out.stats.cache_misses == 0
            for k in (2, 4):
                out = trees.complete(p, max_new_tokens=N_NEW, proposer="draft", k=k)
                assert out.token_ids == reference, (dtype, p, "tree", k)
                tree_rounds += sum(1 for r in out.stats.rounds if r.tree)
    # Trees were verified (counted over all prompts: a prompt whose text ends after a round or two
    # may have none of its own).
    assert tree_rounds > 0


def test_concurrent_streams_are_target_only_in_the_dtype(stack) -> None:
    s, dtype = stack
    with Client(s.addresses["orch"], timeout=120) as c:
        reference = {p: c.complete(p, max_new_tokens=N_NEW, proposer="none").token_ids for p in PROMPTS}
    jobs = [(p, options) for p in PROMPTS for options in (dict(), dict(proposer="draft", k=4))][:12]
    jobs += [(p, dict(tree=True)) for p in PROMPTS[:4]]

    def run(job):
        p, options = job
        tree = options.pop("tree", False) if "tree" in options else False
        options = dict(options)
        with Client(s.addresses["trees" if tree else "orch"], timeout=120) as c:
            return c.complete(p, max_new_tokens=N_NEW, **({"proposer": "draft", "k": 3} if tree else options)).token_ids

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, [(p, dict(o)) for p, o in jobs]))
    assert got == [reference[p] for p, _ in jobs], dtype


def test_seeded_sampling_is_target_onlys_text_for_the_seed_in_the_dtype(stack) -> None:
    s, dtype = stack
    options = dict(max_new_tokens=N_NEW, temperature=0.8, top_p=0.95, ignore_eos=True)
    with Client(s.addresses["orch"], timeout=120) as c, Client(s.addresses["trees"], timeout=120) as trees:
        for p in PROMPTS[:3]:
            for seed in (3, 11):
                want = c.complete(p, seed=seed, proposer="none", **options).token_ids
                assert c.complete(p, seed=seed, **options).token_ids == want, (dtype, p, seed)
                assert trees.complete(p, seed=seed, proposer="draft", k=3, **options).token_ids == want


def test_an_eagle3_head_drafts_exactly_in_bfloat16(tiny_pair, tmp_path_factory) -> None:
    torch.set_num_threads(1)
    s = _stack(tiny_pair, tmp_path_factory.mktemp("eagle3-bf16"), "bfloat16", head=True)
    try:
        with Client(s.addresses["orch"], timeout=120) as c, Client(s.addresses["trees"], timeout=120) as trees:
            accepted = 0
            for p in PROMPTS[:4]:
                reference = c.complete(p, max_new_tokens=N_NEW, proposer="none").token_ids
                for options in (dict(proposer="draft", k=4), dict()):
                    out = c.complete(p, max_new_tokens=N_NEW, **options)
                    assert out.token_ids == reference, (p, options)
                    accepted += sum(r.accepted for r in out.stats.rounds)
                assert trees.complete(p, max_new_tokens=N_NEW, proposer="draft", k=3).token_ids == reference
            assert accepted > 0
    finally:
        s.stop()


def test_auto_serves_the_devices_fast_dtype(tiny_pair, tmp_path_factory) -> None:
    """--dtype auto (the services' default): bfloat16 where the CPU has native bf16, else float32."""
    s = Stack(logs=tmp_path_factory.mktemp("auto"))
    try:
        address = s.start_service("target", "target", tiny_pair[0], register=False, extra=("--dtype", "auto"))
        assert _info(address).dtype == auto("cpu")
    finally:
        s.stop()


def test_a_target_that_would_not_be_exact_does_not_start(tiny_pair, tmp_path_factory) -> None:
    """The stock forward (--max-batch 1) in bfloat16 rounds by the token count: the target exits
    with status 2 and says why, instead of serving."""
    logs = tmp_path_factory.mktemp("inexact")
    port = procs.free_port()
    argv = service_argv("target", port, model=tiny_pair[0], threads=1, dtype="bfloat16",
                        extra=("--max-batch", "1", "--max-k", "8"))
    proc = procs.start(argv, env=ENV, log_path=logs / "target.log")
    try:
        assert proc.wait(timeout=120) == 2
    finally:
        procs.stop(proc)
    log = (logs / "target.log").read_text()
    assert "not bitwise invariant" in log and "does not start" in log and "--no-batch-invariant" in log


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_the_embedded_target_is_exact_in_bfloat16(tmp_path_factory, dtype) -> None:
    """The control with near ties: SmolLM2 and the shipped draft in bfloat16, held-out prompts."""
    import json
    from pathlib import Path

    rows = Path(__file__).resolve().parents[2] / "distill" / "prompt_sets" / "distill_heldout_v2.jsonl"
    prompts = [json.loads(line)["messages"] for line in rows.read_text().splitlines() if line.strip()][:4]
    s = Stack(logs=tmp_path_factory.mktemp("embedded-bf16"))
    try:
        t = s.start_service("target", "target", None, register=False, wait=False, extra=("--dtype", dtype))
        d = s.start_service("draft", "draft", None, register=False, wait=False, extra=("--dtype", dtype))
        s.wait_serving("target", "draft")
        s.start_orchestrator("orch", None, targets=[t], drafts=[d], extra=("--rate-per-tenant", "0"))
        with Client(s.addresses["orch"], timeout=300) as c:
            for messages in prompts:
                reference = c.complete(messages=messages, max_new_tokens=40, proposer="none").token_ids
                for options in (dict(), dict(proposer="lookup", k=6)):
                    out = c.complete(messages=messages, max_new_tokens=40, **options)
                    assert out.token_ids == reference, (messages[-1]["content"][:40], options)
    finally:
        s.stop()

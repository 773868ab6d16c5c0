"""TargetService.Score on a real process with the tiny target."""
from __future__ import annotations

import random
import threading

import grpc
import pytest
import torch

from engine.pool import BLOCK_SIZE
from specdec.runtime.errors import is_cache_miss
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs
from tests.service.conftest import score, scrape, temperature

PROBS = common_pb2.OUTPUT_MODE_PROBS
TOL = 1e-5  # float32: one pass vs one-token passes differ in the last bits only

PROMPT = "The quick brown fox jumps over the lazy dog while the cat"


@pytest.mark.parametrize(
    "sampling",
    [None, temperature(1.0), temperature(0.7, top_k=20, top_p=0.9)],
    ids=["greedy", "t1", "t0.7-topk-topp"],
)
def test_one_pass_predicts_every_position(target, tokenizer, reference, sampling) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    kw = {"output_mode": PROBS} | ({"sampling": sampling} if sampling else {})
    one = score(target.stub, f"one-{id(sampling)}", toks, 0, toks, k=len(toks) - 1, **kw)
    assert one.cache_length == len(toks)
    ids, rows = [], []
    for i, token in enumerate(toks):
        step = score(target.stub, f"steps-{id(sampling)}", toks, i, [token], **kw)
        assert step.cache_length == i + 1
        ids += step.argmax_ids
        rows.append(decode_probs(step.probs))
    assert list(one.argmax_ids) == ids
    torch.testing.assert_close(decode_probs(one.probs), torch.cat(rows), atol=TOL, rtol=0)
    # ...and both agree with plain transformers recomputing the whole prefix.
    with torch.inference_mode():
        logits = reference[0](torch.tensor([toks])).logits[0]  # [n, vocab]
    assert list(one.argmax_ids) == logits.argmax(-1).tolist()


def test_rejection_then_append_equals_fresh_session(target, tokenizer) -> None:
    prompt = tokenizer(PROMPT)["input_ids"]
    stub = target.stub
    opts = {"output_mode": PROBS, "sampling": temperature(1.0)}
    first = score(stub, "rej", prompt, 0, prompt, **opts)
    committed = prompt + list(first.argmax_ids)  # target holds len(prompt)
    drafts = [11, 12, 13]
    round1 = score(stub, "rej", committed, len(prompt), committed[len(prompt):] + drafts, k=3, **opts)
    assert round1.cache_length == len(committed) + 3
    # Accept one drafted token, then a recovered token the target did not see.
    committed += [drafts[0], 42]
    new_drafts = [7, 8]
    keep = len(committed) - 1
    again = score(stub, "rej", committed, keep, committed[keep:] + new_drafts, k=2, **opts)
    fresh = score(stub, "rej-fresh", committed, 0, committed + new_drafts, k=2, **opts)
    assert again.cache_length == fresh.cache_length == len(committed) + 2
    assert list(again.argmax_ids) == list(fresh.argmax_ids)
    torch.testing.assert_close(decode_probs(again.probs), decode_probs(fresh.probs), atol=TOL, rtol=0)


def _miss(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert is_cache_miss(info.value), info.value.details()
    return info.value


def test_cache_miss_is_detected_and_changes_nothing(target, tokenizer) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    stub = target.stub
    base = score(stub, "miss", toks, 0, toks[:6])
    # Unknown session, position beyond what is held, a different history.
    assert "holds nothing" in _miss(lambda: score(stub, "never-seen", toks, 3, toks[3:6])).details()
    assert "is not held" in _miss(lambda: score(stub, "miss", toks, 7, toks[7:9])).details()
    other = list(toks)
    other[2] = (other[2] + 1) % 384
    assert "prefix_hash" in _miss(lambda: score(stub, "miss", other, 5, other[5:7])).details()
    # The misses changed nothing: the session still holds its 6 tokens.
    cont = score(stub, "miss", toks, 6, toks[6:8])
    fresh = score(stub, "miss-fresh", toks, 0, toks[:8])
    assert cont.cache_length == 8 and list(cont.argmax_ids) == list(fresh.argmax_ids)
    assert base.cache_length == 6
    # Release frees it: the next call with a cached prefix misses.
    assert stub.Release(common_pb2.ReleaseRequest(session_id="miss")).released
    assert not stub.Release(common_pb2.ReleaseRequest(session_id="miss")).released
    _miss(lambda: score(stub, "miss", toks, 6, toks[6:8]))
    misses = scrape(target.metrics_port)
    assert misses['specdec_cache_misses_total{reason="prefix_mismatch"}'] >= 1
    assert misses['specdec_cache_misses_total{reason="unknown_session"}'] >= 2


def test_cache_miss_after_restart_then_recovers(services, tiny_pair, tokenizer) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    svc = services("target", tiny_pair[0])
    before = score(svc.stub, "s", toks, 0, toks[:5])
    port = svc.port
    assert svc.stop() == 0  # SIGTERM: graceful, exit 0
    svc = services("target", tiny_pair[0], port=port)
    _miss(lambda: score(svc.stub, "s", toks, 5, toks[5:7]))
    # Recovery: resend every committed token from cache_position 0.
    again = score(svc.stub, "s", toks, 0, toks[:7], k=2)
    assert again.argmax_ids[0] == before.argmax_ids[0]


def test_eviction_by_max_sessions_and_ttl(services, tiny_pair, tokenizer) -> None:
    import time

    toks = tokenizer(PROMPT)["input_ids"]
    svc = services("target", tiny_pair[0], "--max-sessions", "2", "--kv-idle-ttl", "3")
    for name in ("a", "b", "c"):  # the third evicts the least recently used: a
        score(svc.stub, name, toks, 0, toks[:4])
    _miss(lambda: score(svc.stub, "a", toks, 4, toks[4:5]))
    last_use = time.monotonic()  # before the last use: the service's own clock reads it later
    score(svc.stub, "c", toks, 4, toks[4:5])
    assert scrape(svc.metrics_port)['specdec_cache_evictions_total{reason="max_sessions"}'] == 1
    # Idle beyond the TTL: the sweeper frees both (watched without touching them).
    while scrape(svc.metrics_port)["specdec_active_sessions"] > 0:
        assert time.monotonic() - last_use < 20, "idle sessions were never freed"
        time.sleep(0.25)
    assert time.monotonic() - last_use >= 3.0
    _miss(lambda: score(svc.stub, "c", toks, 5, toks[5:6]))
    assert scrape(svc.metrics_port)['specdec_cache_evictions_total{reason="ttl"}'] == 2


def test_eviction_by_memory_budget(services, tiny_pair, tokenizer) -> None:
    toks = tokenizer(PROMPT)["input_ids"][:8]
    # Tiny target KV: 2 layers x (k + v) x 2 heads x 16 dims x 4 bytes = 512 B/token,
    # held in blocks of BLOCK_SIZE tokens, so a budget of 1.5 blocks is a pool of one
    # block: it holds one 8-token session but not two.
    block = BLOCK_SIZE * 512
    svc = services("target", tiny_pair[0], "--cache-budget-mb", str(1.5 * block / 2**20))
    score(svc.stub, "first", toks, 0, toks)
    score(svc.stub, "second", toks, 0, toks)
    _miss(lambda: score(svc.stub, "first", toks, 8, [1]))
    metrics = scrape(svc.metrics_port)
    assert metrics['specdec_cache_evictions_total{reason="budget"}'] == 1
    assert metrics["specdec_cache_bytes"] == block
    # A session longer than the whole pool gets RESOURCE_EXHAUSTED, and the service goes on.
    long = (toks * 4)[:BLOCK_SIZE + 1]
    with pytest.raises(grpc.RpcError) as err:
        score(svc.stub, "third", long, 0, long)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV pool full" in err.value.details()
    score(svc.stub, "fourth", toks, 0, toks)


def _rounds(stub, session: str, prompt: list[int], seed: int) -> list[list[int]]:
    """A deterministic sequence of Score rounds; returns every argmax list."""
    rng = random.Random(seed)
    committed = list(prompt)
    held = 0
    out = []
    for _ in range(6):
        drafts = [rng.randrange(3, 384) for _ in range(rng.randrange(0, 4))]
        reply = score(stub, session, committed, held, committed[held:] + drafts, k=len(drafts))
        out.append(list(reply.argmax_ids))
        accepted = rng.randrange(0, len(drafts) + 1)
        held = len(committed) + accepted
        committed += drafts[:accepted] + [reply.argmax_ids[accepted]]
    return out


def test_interleaved_sessions_equal_sessions_run_alone(target, tokenizer) -> None:
    prompts = [tokenizer(PROMPT)["input_ids"], tokenizer("def add(a, b): return")["input_ids"]]
    alone = [_rounds(target.stub, f"alone-{i}", p, seed=i) for i, p in enumerate(prompts)]
    results: dict[int, list[list[int]]] = {}
    barrier = threading.Barrier(2)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = _rounds(target.stub, f"together-{i}", prompts[i], seed=i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results[0], results[1]] == alone


def test_metrics_count_the_work(target, tokenizer) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    before = scrape(target.metrics_port)
    score(target.stub, "metrics", toks, 0, toks)
    after = scrape(target.metrics_port)
    assert after["specdec_tokens_scored_total"] - before.get("specdec_tokens_scored_total", 0) == len(toks)
    key = 'specdec_requests_total{code="OK",method="/specdec.v1.TargetService/Score"}'
    assert after[key] - before.get(key, 0) == 1
    assert after['specdec_forward_seconds_count{verb="score"}'] >= 1
    assert after["specdec_cache_bytes"] > 0


def _status(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


BAD_SCORES = [
    ({"tokens": [5, 384]}, grpc.StatusCode.INVALID_ARGUMENT, "tokens[1]"),
    ({"tokens": [-1]}, grpc.StatusCode.INVALID_ARGUMENT, "tokens[0]"),
    ({"tokens": []}, grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    ({"k": 33, "tokens": [5] * 40}, grpc.StatusCode.INVALID_ARGUMENT, "k 33"),
    ({"k": 3, "tokens": [5] * 3}, grpc.StatusCode.INVALID_ARGUMENT, "k 3"),
    ({"tokens": [5] * 513}, grpc.StatusCode.OUT_OF_RANGE, "context length"),
    ({"tokens": [5] * 601}, grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens"),
    ({"sampling": temperature(-1.0)}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ({"sampling": temperature(1.0, top_p=0.0)}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ({"sampling": temperature(1.0, top_p=1.5)}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
    ({"sampling": temperature(1.0, top_k=-3)}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k"),
    ({"output_mode": 7}, grpc.StatusCode.INVALID_ARGUMENT, "output_mode"),
    ({"session_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
]


@pytest.mark.parametrize("fields, code, name", BAD_SCORES, ids=[f"{c.name}-{n}-{i}" for i, (_, c, n) in enumerate(BAD_SCORES)])
def test_bad_score_requests_get_a_clear_status(target, fields, code, name) -> None:
    request = {"session_id": "bad", "tokens": [5, 6, 7]} | fields
    error = _status(lambda: target.stub.Score(model_pb2.ScoreRequest(**request), timeout=30))
    assert error.code() == code, error.details()
    assert name in error.details()
    # The server is still fine afterwards.
    assert target.stub.Score(model_pb2.ScoreRequest(session_id="ok", tokens=[5]), timeout=30).argmax_ids


def test_context_overflow_counts_the_cached_prefix(target) -> None:
    toks = [5] * 500
    score(target.stub, "long", toks, 0, toks)
    error = _status(lambda: score(target.stub, "long", toks, 500, [5] * 13))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE and "context length 512" in error.details()

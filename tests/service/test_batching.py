"""Cross-session batching on real service processes (tiny models).

The `target` / `draft` fixtures run with the default --max-batch 16; the
references here run the same models with --max-batch 1 (one request per
forward, a DynamicCache per session: the unbatched path). Concurrent calls
through the batched service must give what the unbatched one gives: greedy
identical, probabilities within 1e-5.
"""
from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specdec.core.fingerprint import fingerprint
from specdec.runtime.errors import is_cache_miss
from specdec.v1 import common_pb2, model_pb2
from specdec.runtime.wire import decode_probs
from tests.service.conftest import LIMITS, MAX_K, propose, score, scrape, temperature

PROBS = common_pb2.OUTPUT_MODE_PROBS
# The batched service feeds long prompts in 64-token chunks and runs other GEMM
# shapes than the unbatched one: float32 rounding differs in the last bits
# (observed up to 1.1e-5 on the tiny model's very peaked distributions).
TOL = 5e-5
SAMPLINGS = [None, temperature(1.0), temperature(0.7, top_k=20, top_p=0.9)]


@pytest.fixture(scope="module")
def target_one(services, tiny_pair):
    return services("target", tiny_pair[0], *LIMITS, "--max-k", str(MAX_K["target"]), "--max-batch", "1")


@pytest.fixture(scope="module")
def draft_one(services, tiny_pair):
    return services("draft", tiny_pair[1], *LIMITS, "--max-k", str(MAX_K["draft"]), "--max-batch", "1")


def _together(n: int, fn: Callable[[int], object]) -> list:
    """fn(0..n-1) on n threads released at once; results in order."""
    barrier = threading.Barrier(n)

    def run(i: int):
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


def _prompt(i: int) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(3, 384) for _ in range(4 + 9 * i)]  # 4..139 tokens: some chunked


def _score_rounds(stub, session: str, i: int, rounds: int = 5) -> list[tuple[list[int], torch.Tensor, int]]:
    """A deterministic stream of Score rounds with mixed k and sampling; (argmax, probs, rows) each."""
    rng = random.Random(i)
    sampling = SAMPLINGS[i % len(SAMPLINGS)]
    kw = {"output_mode": PROBS} | ({"sampling": sampling} if sampling else {})
    committed, held, out = _prompt(i), 0, []
    for _ in range(rounds):
        drafts = [rng.randrange(3, 384) for _ in range(rng.randrange(0, 6))]
        reply = score(stub, session, committed, held, committed[held:] + drafts, k=len(drafts), **kw)
        assert reply.cache_length == len(committed) + len(drafts)
        out.append((list(reply.argmax_ids), decode_probs(reply.probs), reply.timing.batch_rows))
        accepted = rng.randrange(0, len(drafts) + 1)
        held = len(committed) + accepted
        committed += drafts[:accepted] + [reply.argmax_ids[accepted]]
    return out


def _same(batched, alone) -> None:
    for b, a in zip(batched, alone):
        assert b[0] == a[0]
        torch.testing.assert_close(b[1], a[1], atol=TOL, rtol=0)


def test_batched_scores_equal_unbatched(target, target_one) -> None:
    n = 16
    batched = _together(n, lambda i: _score_rounds(target.stub, f"mix-{i}", i))
    alone = [_score_rounds(target_one.stub, f"mix-{i}", i) for i in range(n)]
    for b, a in zip(batched, alone):
        _same(b, a)
    assert max(rows for stream in batched for _, _, rows in stream) > 1, "no batch ever formed"
    assert all(rows == 1 for stream in alone for _, _, rows in stream)
    metrics = scrape(target.metrics_port)
    assert metrics["specdec_batch_rows_count"] >= 1
    assert metrics["specdec_batch_rows_sum"] > metrics["specdec_batch_rows_count"]  # some > 1
    assert metrics["specdec_batch_tokens_sum"] >= sum(len(_prompt(i)) for i in range(n))
    assert metrics["specdec_queue_seconds_count"] >= n * 5


def test_timing_reports_the_batch(target) -> None:
    reply = score(target.stub, "timing", [5, 6, 7], 0, [5, 6, 7])
    t = reply.timing
    assert t.batch_rows >= 1 and t.batch_tokens >= 3 and t.forwards == 1 and t.forward_ms > 0
    long = [5] * 150  # fed in 64-token chunks at fixed positions: 3 forwards
    reply = score(target.stub, "timing-long", long, 0, long)
    assert reply.timing.forwards == 3


def _propose_stream(stub, session: str, i: int) -> list[tuple[list[int], torch.Tensor | None, int]]:
    rng = random.Random(50 + i)
    sampling = SAMPLINGS[i % len(SAMPLINGS)]
    kw = {"output_mode": PROBS, "seed": 7 + i} | ({"sampling": sampling} if sampling else {})
    if i % 4 == 3:
        kw["p_min"] = 0.3
    committed, held, out = _prompt(i), 0, []
    for _ in range(4):
        k = rng.randrange(0, MAX_K["draft"] + 1)  # mixed k: some leave the batch early
        reply = propose(stub, session, committed, held, committed[held:], k=k, **kw)
        out.append((list(reply.tokens), decode_probs(reply.probs), reply.cache_length))
        accepted = rng.randrange(0, len(reply.tokens) + 1)
        held = min(reply.cache_length, len(committed) + accepted)
        committed += list(reply.tokens[:accepted]) + [rng.randrange(3, 384)]
    return out


def test_batched_proposals_equal_unbatched(draft, draft_one) -> None:
    n = 12
    batched = _together(n, lambda i: _propose_stream(draft.stub, f"prop-{i}", i))
    alone = [_propose_stream(draft_one.stub, f"prop-{i}", i) for i in range(n)]
    for b, a in zip(batched, alone):
        for (bt, bq, bl), (at, aq, al) in zip(b, a):
            assert bt == at and bl == al
            torch.testing.assert_close(bq, aq, atol=TOL, rtol=0)
    assert scrape(draft.metrics_port)["specdec_batch_rows_sum"] > scrape(draft.metrics_port)["specdec_batch_rows_count"]


def test_sessions_never_see_each_others_kv(target, target_one) -> None:
    """16 sessions with different prompts, interleaved one call at a time in a shuffled order."""
    n = 16
    prompts = [_prompt(i) for i in range(n)]
    held = [0] * n
    committed = [list(p) for p in prompts]
    order = [i for _ in range(4) for i in range(n)]
    random.Random(5).shuffle(order)

    def call(i: int):
        reply = score(target.stub, f"leak-{i}", committed[i], held[i], committed[i][held[i]:])
        held[i] = len(committed[i])
        committed[i].append(reply.argmax_ids[-1])

    # Threads start calls in a shuffled order; each session's calls stay in sequence.
    locks = [threading.Lock() for _ in range(n)]

    def guarded(i: int) -> None:
        with locks[i]:
            call(i)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(guarded, order))
    for i in range(n):
        fresh = score(target_one.stub, f"leak-fresh-{i}", committed[i], 0, committed[i][:-1])
        assert fresh.argmax_ids[-1] == committed[i][-1], f"session {i} saw another's cache"


def test_cancelling_one_call_leaves_the_others_and_its_session_intact(target, target_one) -> None:
    n = 8
    long = [random.Random(9).randrange(3, 384) for _ in range(500)]  # 8 prefill chunks

    def stream(i: int):
        if i == 0:
            future = target.stub.Score.future(model_pb2.ScoreRequest(session_id="cancel-me", tokens=long),
                                              timeout=60)
            future.cancel()
            return None
        return _score_rounds(target.stub, f"cancel-other-{i}", i)

    results = _together(n, stream)
    for i in range(1, n):
        _same(results[i], _score_rounds(target_one.stub, f"cancel-ref-{i}", i))
    # Whatever the cancelled call left, the session is consistent: a call naming
    # the full prompt either misses cleanly or gives the unbatched answer.
    try:
        reply = score(target.stub, "cancel-me", long + [5], len(long), [5])
    except grpc.RpcError as error:
        assert is_cache_miss(error), error.details()
        reply = score(target.stub, "cancel-me", long + [5], 0, long + [5])
    ref = score(target_one.stub, "cancel-me-ref", long + [5], 0, long + [5])
    assert reply.argmax_ids[-1] == ref.argmax_ids[-1]


def test_bad_input_fails_only_its_own_request(target, target_one) -> None:
    good = [5, 6, 7, 8, 9]
    bad = {
        1: (model_pb2.ScoreRequest(session_id="bad-1", tokens=[5, 384]), grpc.StatusCode.INVALID_ARGUMENT),
        3: (model_pb2.ScoreRequest(session_id="bad-3", tokens=[5, 6], k=5), grpc.StatusCode.INVALID_ARGUMENT),
        5: (model_pb2.ScoreRequest(session_id="bad-5", tokens=[5], cache_position=3, prefix_hash=1),
            grpc.StatusCode.FAILED_PRECONDITION),
    }

    def call(i: int):
        if i in bad:
            with pytest.raises(grpc.RpcError) as info:
                target.stub.Score(bad[i][0], timeout=60)
            return info.value.code()
        return list(score(target.stub, f"good-{i}", good, 0, good + [i + 10], k=1).argmax_ids)

    results = _together(8, call)
    for i, result in enumerate(results):
        if i in bad:
            assert result == bad[i][1]
        else:
            assert result == list(score(target_one.stub, f"good-ref-{i}", good, 0, good + [i + 10], k=1).argmax_ids)


def test_eviction_and_cache_miss_recovery_under_concurrency(services, tiny_pair, target_one) -> None:
    svc = services("target", tiny_pair[0], *LIMITS, "--max-sessions", "4")

    def stream(i: int) -> list[list[int]]:
        committed, held, out = _prompt(i)[:20], 0, []
        for _ in range(6):
            try:
                reply = score(svc.stub, f"evict-{i}", committed, held, committed[held:])
            except grpc.RpcError as error:
                assert is_cache_miss(error), error.details()
                reply = score(svc.stub, f"evict-{i}", committed, 0, committed)  # recovery
            out.append(list(reply.argmax_ids))
            held = len(committed)
            committed = committed + [reply.argmax_ids[-1]]
        return out

    batched = _together(12, stream)
    for i in range(12):
        committed = _prompt(i)[:20]
        for got in batched[i]:
            want = score(target_one.stub, f"evict-ref-{i}", committed, 0, committed)
            assert got[-1] == want.argmax_ids[-1]
            committed = committed + [got[-1]]
    metrics = scrape(svc.metrics_port)
    assert metrics['specdec_cache_evictions_total{reason="max_sessions"}'] >= 8
    assert metrics["specdec_active_sessions"] <= 4

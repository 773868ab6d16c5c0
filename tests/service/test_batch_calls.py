"""ScoreBatch and ProposeBatch on real service processes: one status per item, one forward for all."""
from __future__ import annotations

import grpc

from specdec.core.fingerprint import fingerprint
from specdec.v1 import model_pb2
from tests.service.conftest import propose, score, temperature


def _score_request(session: str, tokens: list[int], cache_position: int = 0, committed=None, k: int = 0):
    committed = committed if committed is not None else tokens
    return model_pb2.ScoreRequest(session_id=session, cache_position=cache_position,
                                  prefix_hash=fingerprint(committed[:cache_position]), tokens=tokens, k=k)


def test_score_batch_items_match_single_calls_and_fail_alone(target) -> None:
    prompts = [[5 + i, 9, 11 + i, 40, 41 + i, 7] for i in range(6)]
    singles = [score(target.stub, f"single-{i}", p, 0, p, k=2).argmax_ids for i, p in enumerate(prompts)]
    items = [_score_request(f"batch-{i}", p, k=2) for i, p in enumerate(prompts)]
    items.insert(2, _score_request("batch-miss", [1, 2], cache_position=5, committed=[1, 2, 3, 4, 5]))
    items.insert(4, _score_request("batch-bad", [1, 10_000_000]))
    reply = target.stub.ScoreBatch(model_pb2.ScoreBatchRequest(items=items), timeout=60)
    assert len(reply.items) == len(reply.status) == len(items)
    codes = [s.code for s in reply.status]
    assert codes[2] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert reply.status[2].message.startswith("cache miss:")
    assert codes[4] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "tokens[1]" in reply.status[4].message
    good = [i for i, c in enumerate(codes) if c == 0]
    assert len(good) == 6
    assert [list(reply.items[i].argmax_ids) for i in good] == [list(a) for a in singles]
    # The six shared one forward.
    assert all(reply.items[i].timing.batch_rows == 6 for i in good)
    # The sessions are usable afterwards like any other.
    again = score(target.stub, "batch-0", prompts[0] + [3], len(prompts[0]), [3])
    assert again.cache_length == len(prompts[0]) + 1


def test_propose_batch_items_match_single_calls(draft) -> None:
    prompts = [[5 + i, 9, 11 + i, 40] for i in range(4)]
    sampled = dict(sampling=temperature(0.8), seed=7)
    singles = [propose(draft.stub, f"psingle-{i}", p, 0, p, k=3 + i, **sampled).tokens
               for i, p in enumerate(prompts)]
    items = [model_pb2.ProposeRequest(session_id=f"pbatch-{i}", prefix_hash=fingerprint([]), tokens=p,
                                      k=3 + i, **sampled) for i, p in enumerate(prompts)]
    reply = draft.stub.ProposeBatch(model_pb2.ProposeBatchRequest(items=items), timeout=60)
    assert [s.code for s in reply.status] == [0] * 4
    assert [list(r.tokens) for r in reply.items] == [list(t) for t in singles]
    assert max(r.timing.batch_rows for r in reply.items) == 4

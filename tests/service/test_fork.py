"""Fork on real target and draft processes (tiny models): a copied prefix scores like the original."""
from __future__ import annotations

import grpc
import pytest

from specdec.core.fingerprint import fingerprint
from specdec.v1 import model_pb2
from tests.service.conftest import score

PROMPT = "The quick brown fox jumps over the lazy dog while the cat"


def _fork(stub, source: str, new: str, tokens: list[int], length: int, **kw):
    return stub.Fork(model_pb2.ForkRequest(session_id=source, new_session_id=new, length=length,
                                           prefix_hash=kw.get("prefix_hash", fingerprint(tokens[:length]))),
                     timeout=30)


def test_a_fork_holds_the_prefix_and_scores_the_same(target, tokenizer):
    toks = tokenizer(PROMPT)["input_ids"]
    score(target.stub, "fork-src", toks, 0, toks)
    n = len(toks) - 1
    assert _fork(target.stub, "fork-src", "fork-dst", toks, n).cache_length == n
    # The fork continues from position n like the source would.
    a = score(target.stub, "fork-dst", toks, n, toks[n:] + [5, 6], k=2)
    b = score(target.stub, "fork-src", toks, n, toks[n:] + [5, 6], k=2)
    assert list(a.argmax_ids) == list(b.argmax_ids) and a.cache_length == b.cache_length == n + 3
    fresh = score(target.stub, "fork-fresh", toks, 0, toks + [5, 6], k=2)
    assert list(a.argmax_ids) == list(fresh.argmax_ids)


def test_the_draft_service_forks_too(draft, tokenizer):
    from tests.service.conftest import propose

    toks = tokenizer(PROMPT)["input_ids"]
    propose(draft.stub, "dfork-src", toks, 0, toks, k=0)
    assert _fork(draft.stub, "dfork-src", "dfork-dst", toks, len(toks)).cache_length == len(toks)
    a = propose(draft.stub, "dfork-dst", toks + [7], len(toks), [7], k=3)
    b = propose(draft.stub, "dfork-src", toks + [7], len(toks), [7], k=3)
    assert list(a.tokens) == list(b.tokens)


@pytest.mark.parametrize("case", ["unknown", "too long", "wrong hash"])
def test_a_fork_of_what_is_not_held_is_a_cache_miss(target, tokenizer, case):
    toks = tokenizer(PROMPT)["input_ids"]
    score(target.stub, "fork-miss", toks, 0, toks)
    kw = {"prefix_hash": 12345} if case == "wrong hash" else {}
    source = "nobody" if case == "unknown" else "fork-miss"
    length = len(toks) + 5 if case == "too long" else 3
    with pytest.raises(grpc.RpcError) as err:
        _fork(target.stub, source, "fork-miss-dst", toks, length, **kw)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("cache miss:")


def test_bad_fork_ids_are_invalid_argument(target):
    for request in (model_pb2.ForkRequest(session_id="a", new_session_id=""),
                    model_pb2.ForkRequest(session_id="a", new_session_id="a"),
                    model_pb2.ForkRequest(session_id="", new_session_id="b")):
        with pytest.raises(grpc.RpcError) as err:
            target.stub.Fork(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

"""Features on the wire, on real processes (tiny models): Score returns the target's, a feature head reads them.

The target's rows equal its normed final hidden states computed in the test
process; a head's drafts equal its reference forward (engine.model.drafts.head_hidden)
driven by the same features, including the rows it must fill with its own
predictions; malformed features are INVALID_ARGUMENT, a head without a feature
for its first token is a cache miss.
"""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.v1 import common_pb2
from specdec.runtime.wire import decode_features, encode_features
from tests.service.conftest import LIMITS, propose, score

PROMPT = "The quick brown fox jumps over the lazy dog while the cat"
F32 = common_pb2.FEATURE_ENCODING_FLOAT32


@pytest.fixture(scope="module")
def head(services, tiny_pair, tmp_path_factory):
    from tests.tiny import build_feature_head

    torch.set_num_threads(1)
    folder = build_feature_head(tiny_pair[0], tmp_path_factory.mktemp("head") / "head")
    return services("draft", folder, *LIMITS, "--max-k", "8"), folder


@pytest.fixture(scope="module")
def models(tiny_pair, head):
    from engine.model import loader

    return loader.load(str(tiny_pair[0])).model, loader.load(str(head[1])).model


def _features(model, ids: list[int]) -> torch.Tensor:
    from engine.model.drafts import target_features

    with torch.no_grad():
        return target_features(model, torch.tensor([ids]))[0]  # [T, H]


def test_score_returns_the_target_features_of_every_token_sent(target, tokenizer, models):
    toks = tokenizer(PROMPT)["input_ids"]
    info = target.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.feature_dim == models[0].config.hidden_size and info.feature_kind == "last-normed"
    first = score(target.stub, "feat-1", toks, 0, toks[:-3], features=F32)
    rest = score(target.stub, "feat-1", toks, len(toks) - 3, toks[-3:], k=2, features=F32)
    assert (first.features.first_position, first.features.rows) == (0, len(toks) - 3)
    assert (rest.features.first_position, rest.features.rows) == (len(toks) - 3, 3)
    got = torch.cat([decode_features(first.features), decode_features(rest.features)])
    ref = _features(models[0], toks)
    assert float((got - ref).abs().max()) < 1e-4 * (1 + float(ref.abs().max()))
    plain = score(target.stub, "feat-2", toks, 0, toks)
    assert not plain.HasField("features")  # only when asked
    # A prompt longer than a prefill chunk (64): the rows of every chunk, in order.
    long = (toks * 12)[:150]
    whole = score(target.stub, "feat-3", long, 0, long, features=F32)
    assert whole.features.rows == 150
    ref = _features(models[0], long)
    assert float((decode_features(whole.features) - ref).abs().max()) < 1e-4 * (1 + float(ref.abs().max()))


def _reference_drafts(head_model, ids: list[int], feats: torch.Tensor, k: int) -> list[int]:
    """Greedy drafts of the head: the prompt with the given features, then its own."""
    from engine.model.drafts import head_hidden

    ids, feats = list(ids), feats.clone()
    out = []
    with torch.no_grad():
        for _ in range(k):
            hidden = head_hidden(head_model, torch.tensor([ids]), feats[None])[0]
            token = int(head_model.lm_head(hidden[-1]).argmax())
            out.append(token)
            ids.append(token)
            feats = torch.cat([feats, hidden[-1:]])
    return out


def test_the_head_drafts_as_its_reference_forward(head, tokenizer, models):
    svc, _ = head
    info = svc.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.feature_dim == models[0].config.hidden_size
    toks = tokenizer(PROMPT)["input_ids"]
    target_f = _features(models[0], toks)
    inputs = torch.cat([torch.zeros_like(target_f[:1]), target_f[:-1]])  # feature of p - 1 with token p
    expected = _reference_drafts(models[1], toks, inputs, 4)
    whole = propose(svc.stub, "h-1", toks, 0, toks, k=4, features=encode_features(inputs, F32))
    assert list(whole.tokens) == expected
    assert whole.cache_length == len(toks) + 3
    # In two calls: the prompt, then its last 4 tokens again with their features.
    propose(svc.stub, "h-2", toks, 0, toks[:-4], k=0, features=encode_features(inputs[:-4], F32))
    again = propose(svc.stub, "h-2", toks, len(toks) - 4, toks[-4:], k=4,
                    features=encode_features(inputs[-4:], F32))
    assert list(again.tokens) == expected
    # Most of what a request may carry (--max-request-tokens 600; the tiny context is 512), each
    # token with an fp32 row: the service's message cap makes room for them.
    long = (toks * 60)[:500]
    rows = encode_features(torch.zeros(len(long), inputs.shape[1]), F32)
    assert len(rows.data) > 10 * 600 + 64 * 1024  # more than a token-only request's cap (the cap before)
    assert len(propose(svc.stub, "h-long", long, 0, long, k=2, features=rows).tokens) == 2
    # Wrong features give other drafts (the head reads them).
    noisy = propose(svc.stub, "h-3", toks, 0, toks, k=4, features=encode_features(inputs * -3.0, F32))
    assert list(noisy.tokens) != expected


def test_tokens_without_rows_are_read_on_the_heads_own_features(head, tokenizer, models):
    from engine.model.drafts import head_hidden

    svc, _ = head
    toks = tokenizer(PROMPT)["input_ids"]
    target_f = _features(models[0], toks)
    inputs = torch.cat([torch.zeros_like(target_f[:1]), target_f[:-1]])
    n = len(toks) - 2  # the last two tokens come without rows: the head uses its own outputs
    with torch.no_grad():
        own = inputs[:n].clone()
        for i in range(n, len(toks)):
            hidden = head_hidden(models[1], torch.tensor([toks[:i]]), own[None])[0]
            own = torch.cat([own, hidden[-1:]])
    expected = _reference_drafts(models[1], toks, own, 3)
    out = propose(svc.stub, "h-own", toks, 0, toks, k=3, features=encode_features(inputs[:n], F32))
    assert list(out.tokens) == expected
    # No row at all: the head continues from its own output at its last fed position.
    drafted = list(out.tokens)
    held = len(toks) + len(drafted) - 1
    more = propose(svc.stub, "h-own", toks + drafted, held, drafted[-1:], k=2)
    assert len(more.tokens) == 2


def test_bad_features_and_missing_ones(head, draft, tokenizer):
    svc, _ = head
    toks = tokenizer(PROMPT)["input_ids"]
    dim = svc.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).feature_dim
    cases = [
        (svc, encode_features(torch.zeros(len(toks) + 1, dim), F32), "rows"),  # more rows than tokens
        (svc, encode_features(torch.zeros(2, dim + 1), F32), "dim"),
        (svc, common_pb2.Features(rows=2, dim=dim, encoding=F32, data=b"\0" * 8), "bytes"),
        (draft, encode_features(torch.zeros(2, dim), F32), "token ids alone"),  # a token draft
    ]
    for service, features, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            propose(service.stub, "bad", toks, 0, toks, k=2, features=features)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    # A head asked to go on without a feature, after a crop that lost its own: a cache miss.
    propose(svc.stub, "h-miss", toks, 0, toks, k=3, features=encode_features(torch.zeros(len(toks), dim), F32))
    with pytest.raises(grpc.RpcError) as info:
        propose(svc.stub, "h-miss", toks, len(toks) - 2, toks[-2:-1], k=2)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details().startswith("cache miss:")


def test_the_stock_forward_refuses_features(services, tiny_pair, tokenizer):
    stock = services("target", tiny_pair[0], "--max-batch", "1")
    assert stock.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).feature_dim == 0
    toks = tokenizer(PROMPT)["input_ids"]
    with pytest.raises(grpc.RpcError) as info:
        score(stock.stub, "s", toks, 0, toks, features=F32)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "features" in info.value.details()


@pytest.fixture(scope="module")
def strong_head(services, tiny_pair, tmp_path_factory):
    """A head whose drafts lean on the features it reads (a large feature weight in its fc)."""
    from tests.tiny import build_feature_head

    folder = build_feature_head(tiny_pair[0], tmp_path_factory.mktemp("strong") / "head", feature_weight=3.0)
    return services("draft", folder, *LIMITS, "--max-k", "8")


def test_the_head_drafts_trees_on_its_own_outputs(strong_head, tokenizer, models):
    """A tree Propose to a feature head: each node read the head's own output at its parent, so
    the path of first children is the greedy chain (which reads the same outputs one by one)."""
    svc = strong_head
    toks = tokenizer(PROMPT)["input_ids"]
    target_f = _features(models[0], toks)
    inputs = torch.cat([torch.zeros_like(target_f[:1]), target_f[:-1]])
    chain = propose(svc.stub, "ht-1", toks, 0, toks, k=4, features=encode_features(inputs, F32))
    tree = propose(svc.stub, "ht-2", toks, 0, toks, k=4, features=encode_features(inputs, F32),
                   tree_nodes=40, tree_width=4)
    parents = list(tree.parents)
    assert len(parents) == len(tree.tokens) > 4 and parents[0] == -1
    node, path = -1, []
    for _ in range(4):  # nodes come by depth, best first: a node's first child is its best
        node = parents.index(node)
        path.append(tree.tokens[node])
    assert path == list(chain.tokens)
    # Zero features give another tree (the nodes read what they are given).
    other = propose(svc.stub, "ht-3", toks, 0, toks, k=4, features=encode_features(inputs * 0.0, F32),
                    tree_nodes=40, tree_width=4)
    assert list(other.tokens) != list(tree.tokens)

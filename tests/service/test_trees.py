"""Token trees on real service processes with the tiny models (engine.tree, draft_service.trees).

Score with ScoreRequest.parents verifies drafts as a tree in one forward: row i + 1 is what
follows drafted token i on its path, as the reference model computes it for that chain. The
next call takes up the path it names by the cache contract, and what follows is computed as
after that chain. Propose with tree_nodes drafts a tree whose nodes are the draft's most
likely continuations.
"""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.core.fingerprint import fingerprint
from tests.service.conftest import propose, score, temperature

PROMPT = "Please rewrite the following sentence: the cat"
TOKENS = [100, 101, 102, 103, 104, 105]
PARENTS = [-1, -1, 0, 0, 2, 1]


def _paths() -> list[list[int]]:
    paths: list[list[int]] = []
    for token, parent in zip(TOKENS, PARENTS):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


def _argmax(model, ids: list[int]) -> int:
    with torch.inference_mode():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


def test_score_verifies_a_tree_in_one_forward(target, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    reply = score(target.stub, "tree-score", toks + TOKENS, 0, toks + TOKENS, k=len(TOKENS), parents=PARENTS)
    assert reply.tree and reply.cache_length == len(toks)  # the nodes are pending, the prompt held
    want = [_argmax(reference[0], toks)] + [_argmax(reference[0], toks + p) for p in _paths()]
    assert list(reply.argmax_ids) == want
    # The next call names the path a -> c -> e: its K/V is taken up, nothing is resent.
    path = _paths()[4]
    nxt = score(target.stub, "tree-score", toks + path + [7], len(toks) + 3, [7], k=0)
    assert list(nxt.argmax_ids) == [_argmax(reference[0], toks + path + [7])]
    assert nxt.cache_length == len(toks) + 4


def test_a_trees_logprobs_are_each_nodes_under_its_parent(target, tokenizer, reference) -> None:
    """Logprobs.drafted[i]: drafted token i's log-probability after its own path (its parent's row);
    the top-n and argmax rows are the tree's rows, row i + 1 after token i's path."""
    toks = tokenizer(PROMPT)["input_ids"]
    reply = score(target.stub, "tree-lp", toks + TOKENS, 0, toks + TOKENS, k=len(TOKENS), parents=PARENTS,
                  logprobs=3)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(reference[0](torch.tensor([ids])).logits[0, -1].float(), -1)

    paths = _paths()
    for i, (token, parent) in enumerate(zip(TOKENS, PARENTS)):
        before = toks + (paths[parent] if parent >= 0 else [])
        assert abs(reply.logprobs.drafted[i] - float(log_softmax(before)[token])) < 1e-3, i
    rows = [toks] + [toks + p for p in paths]
    for r, ids in enumerate(rows):
        top = torch.topk(log_softmax(ids), 3)
        assert list(reply.logprobs.top_ids[3 * r:3 * r + 3]) == top.indices.tolist(), r


def test_a_path_that_is_not_in_the_tree_is_a_cache_miss(target, tokenizer) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    score(target.stub, "tree-miss", toks + TOKENS, 0, toks + TOKENS, k=len(TOKENS), parents=PARENTS)
    with pytest.raises(grpc.RpcError) as err:
        score(target.stub, "tree-miss", toks + [100, 104], len(toks) + 2, [9], k=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cache miss" in err.value.details()


@pytest.mark.parametrize("fields,name", [({"parents": [-1, 5]}, "parents"), ({"parents": [-1]}, "parents")])
def test_bad_trees_are_invalid_arguments(target, tokenizer, fields, name) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    with pytest.raises(grpc.RpcError) as err:
        score(target.stub, "tree-bad", toks + [5, 6], 0, toks + [5, 6], k=2, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()


def test_propose_drafts_a_tree_of_the_drafts_best_continuations(draft, tokenizer, reference) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    reply = propose(draft.stub, "tree-propose", toks, 0, toks, k=4, tree_nodes=10, tree_width=3)
    tokens, parents, held = list(reply.tokens), list(reply.parents), list(reply.held)
    assert len(tokens) == len(parents) == len(held) == 10 and reply.cache_length == len(toks)
    assert all(-1 <= p < i for i, p in enumerate(parents))
    # The first root child is the draft's greedy token; every node is among its parent's top 3.
    assert tokens[0] == _argmax(reference[1], toks)
    paths = []
    for token, parent in zip(tokens, parents):
        path = (paths[parent] if parent >= 0 else []) + [token]
        paths.append(path)
        with torch.inference_mode():
            logits = reference[1](torch.tensor([toks + path[:-1]])).logits[0, -1]
        assert token in torch.topk(logits, 3).indices.tolist()
    # Every node with children was fed (held); the tree goes deeper than one level.
    assert all(held[p] for p in parents if p >= 0) and max(len(p) for p in paths) >= 2
    # The next Propose takes up a held path and drafts on from it.
    path = next(p for p, h in zip(paths, held) if h and len(p) == max(len(q) for q, g in zip(paths, held) if g))
    nxt = propose(draft.stub, "tree-propose", toks + path + [5], len(toks) + len(path), [5], k=2)
    assert list(nxt.tokens)[0] == _argmax(reference[1], toks + path + [5])
    assert nxt.cache_length == len(toks) + len(path) + 2  # + the fed token and the first draft


def test_coupled_trees_rank_by_the_targets_noise(draft, tokenizer) -> None:
    toks = tokenizer(PROMPT)["input_ids"]
    options = dict(k=3, tree_nodes=8, tree_width=3, sampling=temperature(0.9), output_mode=3)
    one = propose(draft.stub, "tree-coupled-1", toks, 0, toks, seed=5, **options)
    again = propose(draft.stub, "tree-coupled-2", toks, 0, toks, seed=5, **options)
    other = propose(draft.stub, "tree-coupled-3", toks, 0, toks, seed=6, **options)
    assert list(one.tokens) == list(again.tokens) and list(one.parents) == list(again.parents)
    assert not one.probs.rows and list(one.tokens) != list(other.tokens)

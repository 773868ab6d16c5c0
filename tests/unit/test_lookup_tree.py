"""Prompt lookup as a token tree (specdec.core.lookup.PromptLookup.propose_tree): what followed
several recent occurrences of the last n-gram, merged into a trie."""
from __future__ import annotations

from specdec.core.lookup import PromptLookup


def lookup(tokens) -> PromptLookup:
    pl = PromptLookup(max_ngram=2, min_ngram=1, num_tokens=8)
    pl.extend(tokens)
    return pl


def paths(tokens, parents) -> set[tuple[int, ...]]:
    """Every root-to-leaf path of a tree."""
    leaves = set(range(len(tokens))) - set(parents)
    out = set()
    for leaf in leaves:
        path, node = [], leaf
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        out.add(tuple(reversed(path)))
    return out


def test_the_tree_merges_recent_continuations_and_starts_with_the_chain() -> None:
    # "1 2" occurs three times before the end, followed by 3 4, 5 6, 3 7; the history ends in "1 2".
    pl = lookup([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 1, 2])
    tokens, parents = pl.propose_tree(limit=2, nodes=16, width=3)
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert paths(tokens, parents) == {(3, 7), (5, 6), (3, 4)}
    assert tokens[:2] == pl.propose(2) == [3, 7]  # the most recent occurrence first: the chain
    assert len(tokens) == 5  # 3 is shared: 3, 7, 5, 6, 4


def test_budgets_width_and_nodes_and_the_chain_when_it_does_not_branch() -> None:
    pl = lookup([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 1, 2])
    tokens, parents = pl.propose_tree(limit=2, nodes=16, width=1)
    assert (tokens, parents) == ([3, 7], [-1, 0])
    tokens, parents = pl.propose_tree(limit=2, nodes=3, width=3)
    assert len(tokens) == 3 and paths(tokens, parents) == {(3, 7), (5,)}
    assert lookup([1, 2, 3]).propose_tree(limit=4, nodes=8, width=3) == ([], [])
    # Only one occurrence: a chain, as propose gives.
    pl = lookup([5, 1, 2, 3, 4, 1, 2])
    assert pl.propose_tree(limit=3, nodes=8, width=3) == (pl.propose(3), [-1, 0, 1])

"""Token trees in the engine: a session's pending tree of fed nodes, and what a tree row sees.

A Score (or a draft's expansion step) may feed its last tokens as a tree: each
node has a parent, another node or -1 for the held prefix's last token. Nodes
are stored after the held prefix in the order they are fed (node i's K/V at
storage position base + i), but each is computed at the position of its depth
(base + depth - 1, for the rotary embedding) and attends to the prefix and its
own ancestors only: exactly what a chain along its path computes.

The session keeps holding the prefix (the cache contract's length); the nodes
stay pending until the next call names a path the only way a call names
anything, by the contract: cache_position base + d with the fingerprint of the
prefix and the path to a node of depth d. That path's K/V is then moved to
positions base .. base + d - 1 and held; the rest of the tree is dropped. A
call naming anything else drops the whole tree (a cache miss if it names a
position the session does not hold).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.core import fingerprint as fp
from specdec.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class TreeRow:
    """What a forward needs of a row whose last tokens are tree nodes (engine.plan.RowPlan.tree)."""

    first: int  # index in the row's tokens of its first tree node (tokens before it: a chain)
    base: int  # storage position of the tree's node 0; keys below it are the held prefix
    positions: list[int]  # rotary position of each of the row's tree nodes: base + depth - 1
    sees: list[list[int]]  # per tree node: the storage positions >= base it attends to (ancestors, itself)


@dataclass
class PendingTree:
    """A session's fed tree nodes, in storage order, above its held prefix."""

    base: int  # the held prefix's length: node i is stored at position base + i
    base_fp: int  # fingerprint of the held prefix
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: the prefix's last token
    depths: list[int] = field(default_factory=list)  # 1: a child of the prefix's last token
    fps: list[int] = field(default_factory=list)  # fingerprint of the prefix + the path to each node

    def add(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        for token, parent in zip(tokens, parents):
            if not -1 <= parent < len(self.tokens):
                raise InvalidArgument(f"parents: node {len(self.tokens)} names parent {parent}, not an "
                                      "earlier node (or -1, the last committed token)")
            self.tokens.append(int(token))
            self.parents.append(int(parent))
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
            self.fps.append(fp.extend(self.base_fp if parent < 0 else self.fps[parent], token))

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node`, in order."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def find(self, depth: int, prefix_hash: int) -> list[int] | None:
        """The path to the node of `depth` whose prefix fingerprint is `prefix_hash`, if any."""
        for node, (d, h) in enumerate(zip(self.depths, self.fps)):
            if d == depth and h == prefix_hash:
                return self.path(node)
        return None

    def row(self, first: int, parents: Sequence[int]) -> TreeRow:
        """The TreeRow of a step adding nodes with `parents` after this tree's nodes (not yet added),
        the step's tree tokens starting at index `first` of its row."""
        n0 = len(self.tokens)
        depths = list(self.depths)
        sees_all = [[self.base + i for i in self.path(j)] for j in range(n0)]
        positions, sees = [], []
        for j, parent in enumerate(parents):
            if not -1 <= parent < n0 + j:
                raise InvalidArgument(f"parents: node {n0 + j} names parent {parent}, not an earlier node "
                                      "(or -1, the last committed token)")
            depth = 1 if parent < 0 else depths[parent] + 1
            depths.append(depth)
            seen = ([] if parent < 0 else sees_all[parent]) + [self.base + n0 + j]
            sees_all.append(seen)
            positions.append(self.base + depth - 1)
            sees.append(seen)
        return TreeRow(first, self.base, positions, sees)

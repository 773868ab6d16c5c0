"""Propose as a token tree: expand the most likely next tokens depth by depth, return the best.

One step per depth, as in dynamic draft trees: the committed tokens are fed,
then at each depth the `width` best candidates (by the product of the draft's
probabilities along their path) are fed together as tree nodes (engine.tree),
each giving its `width` most likely next tokens as candidates of the next
depth. Greedy and rejection-sampled trees rank by the draft's probability; the
coupled sampler by its probability perturbed with the noise the target draws
that position with, so the candidates are the tokens most likely to be the
target's draws. No q is returned: siblings are candidates, not samples. The
`tree_nodes` best candidates of all depths form the tree (a candidate's
ancestors always rank above it). Nodes that were fed stay pending in the
draft's cache; the next call takes up the accepted path's (engine.tree).

A feature head first feeds the committed tokens as a chain does
(draft_service.drafting.HeadFeed), then feeds each expanded node with its own
output at the node's parent (at the last committed token: the feed's last
output). The orchestrator re-feeds an accepted path with the target's
features, so a head never takes up its pending nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_service.drafting import HeadFeed
from engine.host import ModelHost, Work
from engine.plan import LAST, OutputSpec, RowOutput
from engine.scheduler import Step
from engine.sessions import CachedSession
from model_service.requests import ModelRequest

DEFAULT_WIDTH = 4  # candidates per expanded node, and nodes expanded per depth


@dataclass
class Node:
    token: int
    parent: int  # index in TreeProposeWork.nodes; -1 = the last committed token
    depth: int  # 1 = a child of the last committed token
    score: float  # log of the product of the draft's probabilities along the path
    fed: int = -1  # index in the session's pending tree once fed (expanded); -1 = a leaf


@dataclass(frozen=True)
class TreeDrafts:
    tokens: list[int]  # parents first
    parents: list[int]  # index in `tokens`, or -1
    held: list[bool]  # fed: its K/V is pending in the draft's cache
    probs: None = None  # (the chain's Drafts carry q; a tree's nodes are verified by the target's draws)


class TreeProposeWork(Work[TreeDrafts]):
    """Feed the committed tokens, then one step per depth over the frontier; see the module docstring."""

    verb = "propose"

    def __init__(self, host: ModelHost, request: ModelRequest, features: torch.Tensor | None = None):
        self.request = request
        # A feature head: the committed tokens' feed, then each node's own output (its fed row's).
        self.head = HeadFeed(request, features) if host.loaded.feature_dim > 0 else None
        self.feeding = self.head is not None
        self.outputs: dict[int, torch.Tensor] = {}  # node -> [H], the head's output at its position
        self.session_id = request.session_id
        self.cache_position = request.cache_position
        self.prefix_hash = request.prefix_hash
        self.eos_ids = host.eos_ids
        self.width = request.tree_width or DEFAULT_WIDTH
        position = request.cache_position + len(request.tokens)
        context = host.loaded.context_length
        self.depth = max(0, min(request.k, context - position)) if context else request.k
        self.nodes: list[Node] = []
        self.frontier: list[int] = []  # the nodes fed in the last step, in its row order
        self.fed = 0

    def _output(self) -> OutputSpec:
        return OutputSpec(self.request.sampling, coupled_seed=self.request.coupled_seed, candidates=self.width)

    def begin(self) -> Step:
        drafts = bool(self.depth and self.request.tree_nodes)
        if self.head is not None:
            return self.head.begin(self._output() if drafts else OutputSpec())
        return Step(self.request.tokens, 1, self._output()) if drafts else Step(self.request.tokens, 0)

    def joined(self, session: CachedSession, step: Step) -> Step:
        return self.head.joined(session, step) if self.head is not None else step

    def advance(self, session: CachedSession, out: RowOutput) -> Step | None:
        if self.feeding:
            feed = self.head.fed(session, out, self._output())
            if feed is not None:
                return feed
            self.feeding = False
        elif self.head is not None:
            self.outputs.update((node, row) for node, row in zip(self.frontier, out.hidden))
        step = self._expand(out)
        if step is None or self.head is None:
            return step
        own = [self.outputs[n.parent] if n.parent >= 0 else self.head.own[0]
               for n in (self.nodes[i] for i in self.frontier)]
        return step._replace(features=torch.stack(own), hidden=LAST)

    def _expand(self, out: RowOutput) -> Step | None:
        """The candidates the last step gave become nodes; the next depth's best are fed."""
        if out.candidates is None:  # a prefill only
            return None
        before = len(self.nodes)
        for row, parent in zip(out.candidates, self.frontier or [-1]):
            base = self.nodes[parent].score if parent >= 0 else 0.0
            depth = self.nodes[parent].depth + 1 if parent >= 0 else 1
            self.nodes.extend(Node(t, parent, depth, base + lq) for t, lq in zip(*row))
        if len(self.nodes) == before:
            return None  # nothing more to expand
        depth = self.nodes[-1].depth
        if depth >= self.depth:
            return None
        cut = self._selection_floor()
        expand = sorted((i for i, n in enumerate(self.nodes) if n.depth == depth and n.token not in self.eos_ids
                         and n.score >= cut), key=lambda i: -self.nodes[i].score)[: self.width]
        if not expand:
            return None
        parents = []
        for i in expand:
            node = self.nodes[i]
            node.fed, self.fed = self.fed, self.fed + 1
            parents.append(self.nodes[node.parent].fed if node.parent >= 0 else -1)
        self.frontier = expand
        return Step([self.nodes[i].token for i in expand], len(expand), self._output(), parents=parents)

    def _selection_floor(self) -> float:
        """The score a node needs to be among the tree_nodes best so far (a node below it, and so
        every node under it, cannot make the tree)."""
        scores = sorted((n.score for n in self.nodes), reverse=True)
        return scores[self.request.tree_nodes - 1] if len(scores) >= self.request.tree_nodes else float("-inf")

    def result(self) -> TreeDrafts:
        best = sorted(range(len(self.nodes)), key=lambda i: -self.nodes[i].score)[: self.request.tree_nodes]
        chosen = set(best)
        for i in best:  # ties aside, ancestors score higher; keep the tree closed regardless
            while self.nodes[i].parent >= 0 and self.nodes[i].parent not in chosen:
                i = self.nodes[i].parent
                chosen.add(i)
        order = sorted(chosen, key=lambda i: (self.nodes[i].depth, -self.nodes[i].score))
        index = {node: j for j, node in enumerate(order)}
        nodes = [self.nodes[i] for i in order]
        return TreeDrafts([n.token for n in nodes], [index[n.parent] if n.parent >= 0 else -1 for n in nodes],
                          [n.fed >= 0 for n in nodes])

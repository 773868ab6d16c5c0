"""The features that ride on every round, each a small `RoundHook` (orchestrator.round.state).

  GrammarHook    structured output: cuts drafts the grammar forbids, sends the
                 masks of the scored positions, advances the matcher along commits
  FeatureHook    a feature draft: asks Score for the target's features and hands
                 the committed positions' to the relay (orchestrator.proposers.features)
  LogprobsHook   asks Score for log-probabilities and gives each committed token its own
  MinTokensHook  min_tokens: masks the end tokens (EOS, stop token ids) out of the target's p
                 at the first min_tokens generated positions, ANDed with a grammar's mask
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import numpy as np

from orchestrator.common.events import TokenLogprob
from orchestrator.common.grammar import RoundMasks, TurnMatcher
from orchestrator.round.state import Drafts, RoundHook, RoundOutcome, Scores, Turn
from specdec.core import masks
from specdec.core.verify import node_depths
from specdec.runtime.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import common_pb2


def _wire(words: np.ndarray) -> common_pb2.TokenMasks:
    return common_pb2.TokenMasks(rows=len(words), bits=words.astype("<i4").tobytes())


class GrammarHook(RoundHook):
    """Structured output: the turn's grammar state, advanced along commits."""

    def __init__(self, matcher: TurnMatcher) -> None:
        self.matcher = matcher

    def drafted(self, turn: Turn, drafts: Drafts) -> Drafts:
        if drafts.tree:
            return self._prune_tree(drafts)
        # Drafted tokens the grammar forbids cannot commit: cut them (rejection sampling keeps the
        # first one, which its q can reject; the rest are the grammar's forced tokens).
        send_invalid = not turn.sampling.params.greedy and drafts.proposal.probs is not None
        masks = self.matcher.round_masks(drafts.tokens, send_first_invalid=send_invalid, k=drafts.ctx.k)
        return replace(drafts, tokens=masks.proposal(drafts.tokens), own=masks.sent, masks=masks)

    def _prune_tree(self, drafts: Drafts) -> Drafts:
        """A token tree: the nodes the grammar forbids go with their subtrees (TurnMatcher.tree_masks);
        the target scores the rest under a mask per node. No node left: a round with no drafts."""
        proposal = drafts.proposal
        kept, words = self.matcher.tree_masks(drafts.tokens, proposal.parents)
        index = {old: new for new, old in enumerate(kept)}
        parents = [index.get(proposal.parents[i], -1) for i in kept] if kept else None
        held = [proposal.held[i] for i in kept] if proposal.held is not None and kept else None
        return replace(drafts, proposal=replace(proposal, parents=parents, held=held),
                       tokens=[drafts.tokens[i] for i in kept], own=len(kept),
                       masks=RoundMasks(sent=len(kept), valid=len(kept), words=words))

    def score_fields(self, turn: Turn, drafts: Drafts) -> dict[str, Any]:
        return {"allowed": _wire(drafts.masks.words)}

    def committed(self, turn: Turn, outcome: RoundOutcome) -> None:
        self.matcher.commit(outcome.commit.tokens)

    def replay(self, delivered: list[int]) -> None:
        """A resume: the grammar's state after the delivered tokens."""
        try:
            self.matcher.commit(delivered)
        except InvalidArgument:
            raise InvalidArgument("delivered: the tokens do not follow the request's constraint") from None


class FeatureHook(RoundHook):
    """A feature draft's relay of target features (known once the proposer has learnt its kind)."""

    def relay(self, turn: Turn):
        return turn.proposer.features if turn.proposer.proposes else None

    def before_score(self, turn: Turn, drafts: Drafts) -> None:
        relay = self.relay(turn)
        if relay is not None:  # what the target skips, the relay must hold the features of
            turn.session.target.held = min(turn.session.target.held, relay.known)

    def score_fields(self, turn: Turn, drafts: Drafts) -> dict[str, Any]:
        relay = self.relay(turn)
        if relay is None:
            return {}
        return {"features": relay.encoding, "feature_layers": relay.layers} if relay.layers else {"features": relay.encoding}

    def scored(self, turn: Turn, drafts: Drafts, scores: Scores) -> None:
        relay = self.relay(turn)
        if relay is not None and relay.encoding and not scores.reply.response.HasField("features"):
            raise FailedPrecondition(f"features: target replica {turn.session.target.address} returns no "
                                     "features (an older service), which the feature draft needs")

    def committed(self, turn: Turn, outcome: RoundOutcome) -> None:
        relay = self.relay(turn)
        if relay is None:
            return
        sent_before = relay.sent  # the features of the committed tokens the target has read
        drafts, verdict = outcome.drafts, outcome.verdict
        features = outcome.scores.reply.response.features
        kept = _path_rows(features, len(drafts.tokens), verdict.path, relay.width) if drafts.tree else features
        relay.absorb(kept, len(turn.tokens) + min(len(outcome.commit.tokens), verdict.accepted))
        outcome.tally.feature_bytes += len(features.data) + relay.sent - sent_before


def _path_rows(features: common_pb2.Features, n_nodes: int, path, width: int) -> common_pb2.Features:
    """A tree Score's features as a chain: the committed tokens' rows, then the accepted path's nodes'
    (a node's row sits at its own position on its path), the other nodes' dropped."""
    if not features.rows:
        return features
    lead = int(features.rows) - n_nodes
    data = bytes(features.data)
    rows = [data[:lead * width]] + [data[(lead + i) * width:(lead + i + 1) * width] for i in path]
    return common_pb2.Features(first_position=features.first_position, rows=lead + len(path), dim=features.dim,
                               encoding=features.encoding, data=b"".join(rows))


class LogprobsHook(RoundHook):
    """Each committed token's log-probability under the target (and the top alternatives)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.n = max(top, 1)  # the argmax's comes with the top 1

    def score_fields(self, turn: Turn, drafts: Drafts) -> dict[str, Any]:
        return {"logprobs": self.n}

    def scored(self, turn: Turn, drafts: Drafts, scores: Scores) -> None:
        if not scores.reply.response.HasField("logprobs"):
            raise FailedPrecondition(f"logprobs: target replica {turn.session.target.address} does not "
                                     "return log-probabilities (an older service)")

    def tokens(self, outcome: RoundOutcome) -> list[TokenLogprob]:
        """The committed tokens' log-probabilities, from the target's own Logprobs.

        Accepted drafts have theirs in Logprobs.drafted. The extra token is the argmax
        when greedy (Logprobs.argmax), the target's own draw when coupled
        (Logprobs.sampled); drawn by the verifier from p (or the residual), it is read
        from p itself, the very distribution the log-probabilities are taken from.
        """
        lp, verdict, p = outcome.scores.reply.response.logprobs, outcome.verdict, outcome.scores.p
        n, out = lp.top_n, []
        # The row each committed token was chosen at, and an accepted one's drafted index: a tree's
        # j-th token on its path comes from the row after the path's (j - 1)-th node.
        drafted = list(verdict.path) if outcome.drafts.tree else list(range(verdict.accepted))
        rows = [0] + [i + 1 for i in drafted]
        for j, token in enumerate(verdict.tokens[:len(outcome.commit.tokens)]):
            r = rows[j]
            if j < verdict.accepted:
                value = lp.drafted[drafted[j]]
            elif len(lp.sampled) > r:
                value = lp.sampled[r]
            elif p is None:
                value = lp.argmax[r]
            else:
                mass = float(p[r, token])
                value = math.log(mass) if mass > 0 else float("-inf")
            out.append(TokenLogprob(token, value, list(lp.top_ids[r * n:r * n + self.top]),
                                    list(lp.top_logprobs[r * n:r * n + self.top])))
        return out


class MinTokensHook(RoundHook):
    """min_tokens: none of the first `minimum` generated tokens is an end token.

    The target's p at those positions is masked before it is sampled, the path a
    grammar's mask takes (model.proto TokenMasks), so greedy takes the masked argmax and
    sampling draws from the masked, renormalised p: the text is exactly the target's under
    that mask, whatever was drafted (a drafted end token there has p = 0 and is rejected).
    With a grammar the masks are ANDed into its own; where the grammar allows nothing but
    an end token, its mask stands (a complete grammar ends the turn).
    """

    def __init__(self, minimum: int, end_ids: Collection[int], vocab_size: int) -> None:
        self.minimum = minimum
        self.keep = np.full(masks.words_per_position(vocab_size), -1, dtype=np.int32)
        for token in end_ids:
            masks.forbid(self.keep, token)
        self.words: np.ndarray | None = None  # this round's own masks (no grammar)

    def drafted(self, turn: Turn, drafts: Drafts) -> Drafts:
        self.words = None
        window = self.minimum - (len(turn.tokens) - len(turn.req.prompt_ids))
        if window <= 0:  # past the first min_tokens: nothing to mask (nothing sent)
            return drafts
        # A scored row's depth: how many drafted tokens precede its position (a tree: the node's).
        depths = [0] + node_depths(drafts.proposal.parents) if drafts.tree else list(range(len(drafts.tokens) + 1))
        masked = [r for r, depth in enumerate(depths) if depth < window]
        if drafts.masks is not None:  # a grammar's masks, sent by its hook: AND into them
            words = drafts.masks.words.copy()
            for r in masked:
                both = words[r] & self.keep
                if both.any():
                    words[r] = both
            return replace(drafts, masks=replace(drafts.masks, words=words))
        self.words = np.full((len(drafts.tokens) + 1, len(self.keep)), -1, dtype=np.int32)
        self.words[masked] = self.keep
        return drafts

    def score_fields(self, turn: Turn, drafts: Drafts) -> dict[str, Any]:
        return {"allowed": _wire(self.words)} if self.words is not None else {}

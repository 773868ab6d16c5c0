"""A round of typed steps (orchestrator.round.steps): each step returns its own frozen result,
verification goes through one entry that picks the mode (specdec.core.verify.verify_round), and a
round's outcome reaches its observers once, in one place (orchestrator.round.observers)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import orchestrator.round.loop as loop_module
from orchestrator.common.kinds import DRAFT
from orchestrator.proposers.draft import DraftServiceProposer
from orchestrator.round import observers as observers_module
from orchestrator.round import state
from orchestrator.round.state import RoundObserver
from specdec.core.verify import (TargetScores, verify_coupled, verify_greedy, verify_round, verify_sampled,
                                 verify_tree, verify_tree_sampled)
from tests.unit.test_loop import PROMPTS, Stack, make_models, plain_greedy

STEPS = Path(__file__).resolve().parents[2] / "orchestrator" / "round" / "steps.py"
RESULTS = {"plan": "Drafting", "propose": "Drafts", "score": "Scores", "verify": "Verdict",
           "commit": "RoundOutcome"}
# What learns from a round: called only by the observers (and the proposer's own commit).
LEARNING = {"learn", "observe", "record", "add_verdict", "close_round", "observe_round"}


def _probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_verify_round_takes_each_mode_as_its_own_verifier_does() -> None:
    drafted, parents = [3, 1, 4], [-1, 0, -1]
    own = [3, 1, 2, 0]
    p, q = _probs(4, 6, 0), _probs(3, 6, 1)
    greedy, coupled = TargetScores(True, False, argmax_ids=own), TargetScores(False, True, sampled_ids=own)
    by_p = TargetScores(False, False, probs=p)
    assert verify_round(drafted, greedy) == verify_greedy(drafted, own)
    assert verify_round(drafted, coupled) == verify_coupled(drafted, own)
    for seed in range(20):  # the same draws: the seed and the position pass through
        assert verify_round(drafted, by_p, draft_probs=q, seed=seed, position=9) == \
            verify_sampled(drafted, q, p, seed=seed, position=9)
        assert verify_round(drafted, by_p, parents=parents, seed=seed, position=9) == \
            verify_tree_sampled(drafted, parents, p, seed=seed, position=9)
    assert verify_round(drafted, greedy, parents=parents) == verify_tree(drafted, parents, own)
    assert verify_round(drafted, coupled, parents=parents) == verify_tree(drafted, parents, own)
    # Greedy reads the argmax, never the draws (a request both greedy and coupled).
    both = TargetScores(True, True, argmax_ids=own, sampled_ids=[0, 0, 0, 0])
    assert verify_round(drafted, both) == verify_greedy(drafted, own)
    with pytest.raises(ValueError, match="probs"):
        verify_round(drafted, TargetScores(False, False))


def _step_annotations(source: str) -> dict[str, str]:
    tree = ast.parse(source)
    return {node.name: ast.unparse(node.returns) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None}


def _learning_calls(source: str) -> list[str]:
    """Calls of a learning method in a module, outside any function named round_closed."""
    found = []
    for func in ast.parse(source).body:
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or func.name == "round_closed":
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEARNING:
                found.append(f"{func.name}: {ast.unparse(node.func)}")
    return found


def test_each_step_returns_its_own_frozen_result() -> None:
    annotations = _step_annotations(STEPS.read_text())
    assert {name: annotations.get(name) for name in RESULTS} == RESULTS
    for name in ("Drafts", "Scores", "Commit", "RoundOutcome"):
        cls = getattr(state, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
    assert not hasattr(state, "Round"), "the round's mutable bag is back"
    # Every step takes the turn and earlier steps' results, nothing mutable of the round's own.
    for name in RESULTS:
        from orchestrator.round import steps
        params = list(inspect.signature(getattr(steps, name)).parameters)
        assert params[0] == "turn" and "rnd" not in params, (name, params)


def test_a_round_learns_only_through_its_observers() -> None:
    assert _learning_calls(STEPS.read_text()) == []
    # The control: a step that teaches the policy itself is found.
    planted = STEPS.read_text() + "\n\ndef verify_and_learn(turn, drafts):\n    turn.policy.observe(1, 1)\n"
    assert _learning_calls(planted) == ["verify_and_learn: turn.policy.observe"]


def test_every_round_outcome_reaches_every_observer_once(monkeypatch) -> None:
    """On the real loop: each round's one outcome goes to the observers in order (the tally's
    first: the round's time is closed when the others read it), and to the proposer's commit."""
    seen: list[tuple] = []
    commits: list[int] = []

    class Recorder(RoundObserver):
        def round_closed(self, turn, outcome) -> None:
            seen.append((outcome, outcome.tally.total_ms, len(turn.tally.rounds)))

    default = observers_module.observers
    monkeypatch.setattr(loop_module, "observers", lambda: (*default(), Recorder()))
    original_commit = DraftServiceProposer.commit
    monkeypatch.setattr(DraftServiceProposer, "commit",
                        lambda self, done: (commits.append(done.committed), original_commit(self, done))[1])
    target, draft = make_models(0)
    out, _, tally = Stack(target, draft).run(PROMPTS[0], k=4, proposer=DRAFT)
    assert out == plain_greedy(target, PROMPTS[0])
    assert len(seen) == len(tally.rounds) > 3
    for i, (outcome, total_ms, closed) in enumerate(seen):
        assert outcome.tally is tally.rounds[i] and total_ms > 0 and closed == i + 1
    assert [t for outcome, _, _ in seen for t in outcome.commit.tokens] == out
    assert sum(o.verdict.accepted for o, _, _ in seen) == tally.accepted_tokens > 0
    assert [o.drafting.k for o, _, _ in seen] == [r.k for r in tally.rounds]
    assert commits == [len(o.commit.tokens) for o, _, _ in seen]

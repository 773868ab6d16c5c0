"""The loop's per-round details (TurnRequest.round_tokens) and its pass bound (max_target_passes),
on the in-process fakes of test_loop."""
from __future__ import annotations

import asyncio

import pytest

from orchestrator.common.events import ChunkEvent
from orchestrator.round.loop import generate
from orchestrator.round.steps import PASSES
from orchestrator.common.kinds import COMBINED, DRAFT, GUESS, LOOKUP, NONE
from orchestrator.common.request import TurnRequest
from specdec.core.verify import BONUS, RECOVERED
from tests.unit.test_loop import GREEDY, PROMPTS, Stack, make_models, plain_greedy


def _run(stack: Stack, prompt, **spec) -> tuple[list[ChunkEvent], object]:
    async def body():
        chunks, tally = [], None
        full = TurnRequest(prompt_ids=tuple(prompt), sampling=GREEDY, seed=7,
                            **{"max_new_tokens": 48, "k": 4, **spec})
        async for event in generate(full, stack.config):
            if isinstance(event, ChunkEvent):
                chunks.append(event)
            else:
                tally = event
        return chunks, tally

    return asyncio.run(body())


@pytest.mark.parametrize("kind", [DRAFT, LOOKUP, GUESS, NONE, COMBINED])
def test_each_chunk_carries_its_round(kind: str) -> None:
    target, draft = make_models(0)
    prompt = PROMPTS[1]
    reference = plain_greedy(target, prompt)
    guess = tuple(reference[:5] + [(reference[5] + 1) % 24] + reference[6:]) if kind == GUESS else ()
    chunks, tally = _run(Stack(target, draft), prompt, proposer=kind, guess_ids=guess,
                         round_tokens=True)
    assert [t for c in chunks for t in c.token_ids] == reference
    assert [c.round.index for c in chunks] == list(range(1, tally.target_passes + 1))
    kinds = set()
    for chunk, rnd in zip(chunks, tally.rounds):
        d = chunk.round
        assert (d.source, len(d.drafted), d.accepted) == (rnd.source, rnd.drafted, rnd.accepted)
        assert d.committed == chunk.token_ids  # nothing skipped without a resume
        # The committed tokens are the accepted drafts, then the extra token (unless cut).
        assert d.committed[: d.accepted] == d.drafted[: d.accepted]
        assert d.extra_kind == (BONUS if d.accepted == len(d.drafted) else RECOVERED)
        kinds.add(d.extra_kind)
    if kind != NONE:
        assert tally.accepted_tokens > 0 and RECOVERED in kinds
    # Off by default: no detail at all.
    plain, _ = _run(Stack(target, draft), prompt, proposer=kind, guess_ids=guess)
    assert all(c.round is None for c in plain)


@pytest.mark.parametrize("kind", [NONE, DRAFT])
def test_max_target_passes_stops_after_that_many_passes(kind: str) -> None:
    target, draft = make_models(0)
    prompt = PROMPTS[0]
    reference = plain_greedy(target, prompt)
    _, free = _run(Stack(target, draft), prompt, proposer=kind)
    assert free.target_passes > 3
    chunks, tally = _run(Stack(target, draft), prompt, proposer=kind, max_target_passes=3)
    out = [t for c in chunks for t in c.token_ids]
    assert tally.target_passes == 3 and tally.finish_reason == PASSES
    assert out == reference[: len(out)] and len(out) >= 3
    # A bound the turn does not reach changes nothing.
    chunks, tally = _run(Stack(target, draft), prompt, proposer=kind,
                         max_target_passes=free.target_passes)
    assert [t for c in chunks for t in c.token_ids] == reference
    assert tally.finish_reason == free.finish_reason != PASSES

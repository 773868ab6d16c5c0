"""The stream interval (orchestrator.api.interval): chunks gathered to N tokens, nothing lost."""
from __future__ import annotations

from orchestrator.api.interval import ChunkGatherer
from orchestrator.common.events import ChunkEvent, RoundDetail, TokenLogprob


def _chunk(start: int, ids: list[int], *, session_id: str = "", logprobs: bool = False,
           round_detail: RoundDetail | None = None) -> ChunkEvent:
    lps = [TokenLogprob(t, -float(t), [t], [-float(t)]) for t in ids] if logprobs else None
    return ChunkEvent(text="".join(f"<{t}>" for t in ids), token_ids=ids, start_index=start,
                      session_id=session_id, logprobs=lps, round=round_detail)


def _rounds(sizes: list[int], **kw) -> list[ChunkEvent]:
    out, start = [], 10
    for i, n in enumerate(sizes):
        out.append(_chunk(start, list(range(start, start + n)), session_id="s1" if i == 0 else "", **kw))
        start += n
    return out


def _gathered(gatherer: ChunkGatherer, chunks: list[ChunkEvent]) -> list[ChunkEvent]:
    sent = [c for c in (gatherer.add(chunk) for chunk in chunks) if c is not None]
    tail = gatherer.flush()
    return sent + ([tail] if tail is not None else [])


def test_chunks_are_joined_to_the_interval_the_first_at_once_and_the_rest_at_the_end() -> None:
    rounds = _rounds([1, 1, 2, 1, 3, 1, 1, 1], logprobs=True)
    sent = _gathered(ChunkGatherer(4), rounds)
    assert [len(c.token_ids) for c in sent] == [1, 4, 4, 2]  # first alone; 1+2+1, 3+1, then the tail
    assert sent[0] is rounds[0] and sent[0].session_id == "s1"
    # Nothing lost, nothing reordered: the stream reads as the rounds would have.
    assert "".join(c.text for c in sent) == "".join(c.text for c in rounds)
    assert [t for c in sent for t in c.token_ids] == [t for c in rounds for t in c.token_ids]
    assert [lp for c in sent for lp in c.logprobs] == [lp for c in rounds for lp in c.logprobs]
    # Contiguous: each chunk starts where the last ended.
    for before, after in zip(sent, sent[1:]):
        assert after.start_index == before.start_index + len(before.token_ids)
    assert all(not c.session_id for c in sent[1:])


def test_interval_one_sends_every_round_and_round_detail_is_never_joined() -> None:
    rounds = _rounds([1, 2, 1, 1])
    assert _gathered(ChunkGatherer(1), rounds) == rounds
    detail = RoundDetail(index=1, source="", drafted=[], accepted=0, extra_kind="bonus", committed=[7])
    with_detail = _rounds([1, 1, 1, 1], round_detail=detail)
    assert _gathered(ChunkGatherer(8), with_detail) == with_detail  # each round's detail, its own chunk


def test_nothing_held_flushes_to_nothing() -> None:
    gatherer = ChunkGatherer(3)
    assert gatherer.flush() is None
    first, second = _rounds([1, 1])
    assert gatherer.add(first) is first
    assert gatherer.add(second) is None  # held
    assert gatherer.flush() is second and gatherer.flush() is None


def test_an_interval_below_one_refuses_to_start() -> None:
    import asyncio

    import pytest

    from orchestrator.__main__ import StartupError, main_async, parse_args

    with pytest.raises(StartupError, match="--stream-interval: must be >= 1"):
        asyncio.run(main_async(parse_args(["--stream-interval", "0"])))
    assert parse_args([]).stream_interval == 1  # every round, unless asked

"""Prompts written by the target itself (self-instruct), the model-dependent step of the prompt set.

`python -m distill prompts --out DIR` asks the target (greedy) to write
one user request per (instruction, subject) pair, then answers a seeded
selection of the cleaned requests (those answers become the assistant turn of
multi-turn prompts and quoted passages of rewrite/summarize prompts). The raw
outputs are checked in as distill/prompt_sets/distill_generated.jsonl, so building the
prompt set (distill.prompts.build) never needs the model: only this
step does.

Resumable: rows are appended to the file batch by batch, and a rerun skips the
requests (and the answers) already there.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from distill import data, prompts

log = logging.getLogger(__name__)

QUESTION_TOKENS = 40  # a request is one line; the closing quote ends it (see _quote_ids)
ANSWER_TOKENS = 96  # short enough to keep multi-turn prompts cheap to prefill; cut at a sentence end


@cache
def _quote_ids(tokenizer: Any) -> frozenset[int]:
    """Token ids whose text contains a double quote: the end of a quoted request, so generation stops there."""
    return frozenset(i for i in range(len(tokenizer)) if '"' in tokenizer.decode([i]))


def _replies(target: Any, conversations: Sequence[Sequence[dict[str, str]]], max_new_tokens: int,
             prefills: Sequence[str] | None = None, stop_ids: frozenset[int] = frozenset()) -> list[tuple[str, bool]]:
    """Greedy replies of the target to one batch of conversations: (text, finished before the cap).

    A prefill is text the assistant turn starts with; the reply continues it
    (and excludes it). A stop id ends a reply like EOS does, and is kept in its text.
    """
    tok = target.tokenizer
    eos = set(target.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    encoded = [data.encode_prompt(tok, prompts.Prompt(0, "", tuple(c), False)) for c in conversations]
    if prefills is not None:
        encoded = [ids + tok.encode(text, add_special_tokens=False) for ids, text in zip(encoded, prefills)]
    records = data.generate_batch(target.model, encoded, eos | stop_ids, max_new_tokens=max_new_tokens, top_k=1,
                                  pad_id=pad)
    out = []
    for record in records:
        ids = record["response"]
        finished = bool(ids) and ids[-1] in eos | stop_ids
        out.append((tok.decode(ids, skip_special_tokens=True).strip(), finished))
    return out


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _batches(items: list, size: int, what: str) -> Any:
    """Yield `items` in batches of `size`, logging progress."""
    for start in range(0, len(items), size):
        yield items[start:start + size]
        log.info("self-instruct %s: %d of %d", what, min(start + size, len(items)), len(items))


def generate_questions(target: Any, path: Path, batch_size: int) -> None:
    """Phase 1: the target's raw request for every (instruction, subject) pair not yet in the file."""
    done = {(r["instruction"], r["topic"]) for r in prompts.load_generated(path) if r["kind"] == "question"}
    todo = [r for r in prompts.question_requests() if (r[0], r[1]) not in done]
    for batch in _batches(todo, batch_size, "requests"):
        replies = _replies(target, [[{"role": "user", "content": text}] for _, _, text in batch], QUESTION_TOKENS,
                           [prompts.question_prefill(i, t) for i, t, _ in batch], _quote_ids(target.tokenizer))
        _append(path, [{"kind": "question", "instruction": i, "topic": t, "raw": raw}
                       for (i, t, _), (raw, _) in zip(batch, replies)])


def generate_answers(target: Any, path: Path, batch_size: int) -> None:
    """Phase 2: the target's answers to the seeded selection of cleaned requests not yet answered."""
    rows = prompts.load_generated(path)
    done = {r["question"] for r in rows if r["kind"] == "answer"}
    todo = [q for q in prompts.questions_to_answer(rows) if q not in done]
    for batch in _batches(todo, batch_size, "answers"):
        replies = _replies(target, [[{"role": "user", "content": q}] for q in batch], ANSWER_TOKENS)
        _append(path, [{"kind": "answer", "question": q, "raw": raw, "finished": finished}
                       for q, (raw, finished) in zip(batch, replies)])


def run(target: Any, path: Path = prompts.GENERATED_FILE, *, batch_size: int = 64) -> dict[str, int]:
    """Both phases (resuming where a previous run stopped), then rewrite the prompt set from the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    generate_questions(target, path, batch_size)
    generate_answers(target, path, batch_size)
    rows = prompts.load_generated(path)
    return {"questions": len(prompts.self_instruct_questions(rows)), "answers": len(prompts.answered(rows)),
            "prompts": prompts.write()}

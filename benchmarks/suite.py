"""The versioned prompt suite (benchmarks/prompts/suite-v<N>.jsonl).

Each line: {"id", "category", "messages": [{"role", "content"}], "suite_version"}.
A suite file never changes once results were published from it; new or edited
prompts go into suite-v<N+1>.jsonl so old numbers stay reproducible.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SUITE = Path(__file__).parent / "prompts" / "suite-v1.jsonl"
CATEGORIES = ("code", "rewrite", "qa", "writing", "summarize")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def as_dicts(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages]


def load(path: Path = DEFAULT_SUITE) -> list[Prompt]:
    """Read a suite file; raises ValueError naming the line on a malformed entry."""
    prompts = []
    seen = set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            msgs = tuple((m["role"], m["content"]) for m in row["messages"])
            prompt = Prompt(id=row["id"], category=row["category"], messages=msgs)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}:{lineno}: malformed prompt ({exc})") from exc
        if not msgs or prompt.id in seen:
            raise ValueError(f"{path}:{lineno}: empty messages or duplicate id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    return prompts


def subset(prompts: list[Prompt], per_category: int) -> list[Prompt]:
    """The first `per_category` prompts of each category, categories interleaved.

    Interleaving means a shorter run still covers every category.
    """
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out = []
    for i in range(per_category):
        for cat in by_cat:
            if i < len(by_cat[cat]):
                out.append(by_cat[cat][i])
    return out

"""Text between two vocabularies: the target's committed tokens in a draft's ids, and a draft's
drafted text in the target's (orchestrator.proposers.translated). Torch-free: the orchestrator's
start-up builds one."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TAIL = 4  # committed tokens decoded with the drafted ones, so word boundaries re-encode right
REPLACEMENT = "\ufffd"  # a drafted text that ends inside a character


class TextBridge:
    """The target's and the draft's tokenizers: committed text into the draft's ids, drafted text
    into the target's. Pure functions of the tokenizers (tests drive it with tiny ones)."""

    def __init__(self, target: Any, draft: Any) -> None:
        self.target, self.draft = target, draft
        self._draft_specials = frozenset(int(i) for i in getattr(draft, "all_special_ids", ()) or ())

    def draft_ids(self, committed: Sequence[int]) -> list[int]:
        """The committed target tokens as the draft reads them: their text in its vocabulary."""
        text = self.target.decode(list(committed), skip_special_tokens=False)
        return list(self.draft.encode(text, add_special_tokens=True))

    def drafted_text(self, context: Sequence[int], drafted: Sequence[int]) -> str:
        """The text the draft added after `context` (its ids), up to its first special token."""
        cut = next((i for i, t in enumerate(drafted) if t in self._draft_specials), len(drafted))
        tail = list(context[max(0, len(context) - TAIL):])
        before = self.draft.decode(tail, skip_special_tokens=False)
        after = self.draft.decode(tail + list(drafted[:cut]), skip_special_tokens=False)
        if not after.startswith(before):
            return ""
        # Up to a broken character: bytes that are not text do not survive the re-encoding.
        return after[len(before):].split(REPLACEMENT, 1)[0]

    def to_target(self, committed: Sequence[int], text: str) -> list[int]:
        """`text` after the committed tokens, in the target's ids; [] where no re-encoding keeps
        the committed tail as it is (that round then proposes nothing)."""
        if not text:
            return []
        for width in (TAIL, 1):
            tail = list(committed[max(0, len(committed) - width):])
            if not tail:
                return list(self.target.encode(text, add_special_tokens=False))
            ids = list(self.target.encode(self.target.decode(tail, skip_special_tokens=False) + text,
                                          add_special_tokens=False))
            if ids[:len(tail)] == tail:
                return ids[len(tail):]
        return []

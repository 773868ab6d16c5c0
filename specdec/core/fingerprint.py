"""Rolling 64-bit fingerprints of token prefixes, and the fingerprint of a vocabulary.

A service keeps the fingerprint of every prefix it caches; a caller sends the
fingerprint of the prefix it believes is cached. A mismatch is a cache miss,
never a silently wrong continuation. The services and the orchestrator compare
tokenizer fingerprints at start-up and refuse a pair whose vocabularies differ.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

MASK64 = (1 << 64) - 1
EMPTY = 0x9E3779B97F4A7C15  # fingerprint of the empty prefix


def _mix64(z: int) -> int:
    """splitmix64 finaliser: a bijective avalanche on 64 bits."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK64
    return z ^ (z >> 31)


def extend(fingerprint: int, token: int) -> int:
    """Fingerprint of prefix + [token], given the prefix's fingerprint."""
    return _mix64((fingerprint * 0x100000001B3 + (token & 0xFFFFFFFF) + 1) & MASK64)


def prefix_fingerprints(tokens: Iterable[int], start: int = EMPTY) -> list[int]:
    """[fp(tokens[:0]), fp(tokens[:1]), ..., fp(tokens)] starting from `start`."""
    out = [start]
    for token in tokens:
        out.append(extend(out[-1], token))
    return out


def fingerprint(tokens: Iterable[int]) -> int:
    """Fingerprint of a whole token sequence."""
    return prefix_fingerprints(tokens)[-1]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the sorted (token, id) pairs: equal iff the vocabularies match."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()

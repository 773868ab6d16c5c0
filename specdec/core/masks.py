"""Token masks of structured output: which tokens a grammar allows, as packed bits.

The packing is the one grammar matchers fill natively (llguidance, and others):
per position, ceil(vocab / 32) int32 words, bit j of word w allowing token
32 w + j. It travels as is (model.proto TokenMasks: 6 KB per position at a
49k vocabulary, against 196 KB for one float32 distribution) and is unpacked on
the model's device, where the logits are.
"""
from __future__ import annotations

import numpy as np
import torch

_BITS = 32


def words_per_position(vocab_size: int) -> int:
    return (vocab_size + _BITS - 1) // _BITS


def pack(allowed: np.ndarray) -> np.ndarray:  # [positions, vocab] bool -> [positions, words] int32
    """The packed form of a boolean mask (bit order as described above)."""
    positions, vocab = allowed.shape
    padded = np.zeros((positions, words_per_position(vocab) * _BITS), dtype=np.uint64)
    padded[:, :vocab] = allowed
    weights = np.left_shift(np.uint64(1), np.arange(_BITS, dtype=np.uint64))
    words = (padded.reshape(positions, -1, _BITS) * weights).sum(axis=-1)
    return words.astype(np.uint32).view(np.int32)


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[positions, words] int32 (any device) -> [positions, vocab_size] bool on the same device.

    Tokens past the last word (a vocabulary the mask does not cover) are disallowed.
    """
    shifts = torch.arange(_BITS, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [positions, words, 32]
    flat = bits.reshape(words.shape[0], -1).bool()
    if flat.shape[1] >= vocab_size:
        return flat[:, :vocab_size]
    pad = torch.zeros(words.shape[0], vocab_size - flat.shape[1], dtype=torch.bool, device=words.device)
    return torch.cat([flat, pad], dim=1)


def allows(words: np.ndarray, token: int) -> bool:
    """Whether one position's packed mask (int32 words) allows `token`."""
    w = token // _BITS
    return 0 <= w < len(words) and bool((int(words[w]) >> (token % _BITS)) & 1)


def forbid(words: np.ndarray, token: int) -> None:
    """Clear `token`'s bit in one packed row (int32 words), in place."""
    w = token // _BITS
    if 0 <= w < len(words):
        words[w] = np.int32(np.uint32(np.int32(words[w]).view(np.uint32) & ~np.uint32(1 << (token % _BITS))).view(np.int32))


def from_bytes(bits: bytes, positions: int) -> np.ndarray:
    """Wire bytes (little-endian int32; TokenMasks.rows = positions) -> [positions, words] int32."""
    return np.frombuffer(bits, dtype="<i4").reshape(positions, -1)

"""Counter-based randomness: every uniform is a pure function of its coordinates.

uniform(seed, position, purpose) depends on nothing else — no global or
per-process generator state — so a retried or failed-over round draws the
same numbers, and the same seed always gives the same text.
"""
from __future__ import annotations

from enum import IntEnum

from specdec.core.fingerprint import MASK64, _mix64


class Purpose(IntEnum):
    """Which decision a uniform feeds; distinct purposes never share a draw."""

    DRAFT = 1  # the draft's sample at a position
    ACCEPT = 2  # the accept/reject test of a drafted token
    RESAMPLE = 3  # the recovered (residual) or bonus token at a position


def uniform(seed: int, position: int, purpose: Purpose, index: int = 0) -> float:
    """A uniform in [0, 1) with 53 random bits, a pure function of its arguments."""
    z = _mix64((seed & MASK64) ^ 0xD1B54A32D192ED03)
    z = _mix64(z ^ ((position & MASK64) * 0x9E3779B97F4A7C15 & MASK64))
    z = _mix64(z ^ ((int(purpose) << 32 | (index & 0xFFFFFFFF)) * 0xC2B2AE3D27D4EB4F & MASK64))
    return (z >> 11) * (1.0 / (1 << 53))

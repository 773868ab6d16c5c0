"""Counter-based randomness: every uniform is a pure function of its coordinates.

uniform(seed, position, purpose) depends on nothing else — no global or
per-process generator state — so a retried or failed-over round draws the
same numbers, and the same seed always gives the same text.

The coupled sampler (`gumbel_keys`, `gumbel_noise`) draws the token at
absolute position P as argmax over the vocabulary of (log p(v) + G(seed, P, v))
with Gumbel noise G that is, again, a pure function of its coordinates. The
draft service draws its token at P with the same noise, so a token's draw does
not depend on who proposed what (specdec.core.verify.verify_coupled).

Positions are absolute (tokens before the one being decided). After a
rejection at position j, the next round drafts position j + 1 again with the
same DRAFT uniform that produced the discarded drafted token there; that is
safe because nothing committed depended on that draw (the exactness tests in
tests/unit/test_exactness.py run exactly this pattern).
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np

from specdec.core.fingerprint import MASK64, _mix64


class Purpose(IntEnum):
    """Which decision a uniform feeds; distinct purposes never share a draw."""

    DRAFT = 1  # the draft's sample at a position
    ACCEPT = 2  # the accept/reject test of a drafted token
    RESAMPLE = 3  # the recovered (residual) or bonus token at a position
    GUMBEL = 4  # the Gumbel noise of the coupled sampler at a position (one value per token)


def uniform(seed: int, position: int, purpose: Purpose, index: int = 0) -> float:
    """A uniform in [0, 1) with 53 random bits, a pure function of its arguments."""
    z = _mix64((seed & MASK64) ^ 0xD1B54A32D192ED03)
    z = _mix64(z ^ ((position & MASK64) * 0x9E3779B97F4A7C15 & MASK64))
    z = _mix64(z ^ ((int(purpose) << 32 | (index & 0xFFFFFFFF)) * 0xC2B2AE3D27D4EB4F & MASK64))
    return (z >> 11) * (1.0 / (1 << 53))


_U64 = np.uint64


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic, as in _mix64)."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _as_u64(values: int | Sequence[int] | np.ndarray) -> np.ndarray:
    """Python ints (any sign) or an integer array -> uint64, bit pattern mod 2**64."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values if values.dtype == np.uint64 else values.astype(np.int64, copy=False).view(np.uint64)
    if isinstance(values, (int, np.integer)):
        return np.array(int(values) & MASK64, dtype=np.uint64)
    arr = np.asarray(values, dtype=object)
    return np.vectorize(lambda v: int(v) & MASK64, otypes=[np.uint64])(arr) if arr.size else arr.astype(np.uint64)


def uniforms(
    seeds: int | Sequence[int] | np.ndarray,
    positions: int | Sequence[int] | np.ndarray,
    purpose: Purpose,
    index: int = 0,
) -> np.ndarray:  # float64, broadcast shape of seeds and positions
    """Vectorised `uniform`: element i equals uniform(seeds[i], positions[i], purpose, index).

    Bit-for-bit the same numbers as the scalar function, so a batched verifier
    and a one-at-a-time verifier make the same decisions.
    """
    s, p = np.broadcast_arrays(_as_u64(seeds), _as_u64(positions))
    with np.errstate(over="ignore"):
        z = _mix64_array(s ^ _U64(0xD1B54A32D192ED03))
        z = _mix64_array(z ^ (p * _U64(0x9E3779B97F4A7C15)))
        salt = (int(purpose) << 32 | (index & 0xFFFFFFFF)) * 0xC2B2AE3D27D4EB4F & MASK64
        z = _mix64_array(z ^ _U64(salt))
    return (z >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with n choices: choice 0 keeps the request's
    (it is the n = 1 answer), the others get independent streams, a pure function of both.
    Never 0 (which means "pick one at random")."""
    if index == 0:
        return seed
    z = _mix64((seed & MASK64) ^ _mix64((index & MASK64) * 0xA24BAED4963EE407 & MASK64))
    return z or 1


# Multiplier spreading token ids over 64 bits before the finaliser (an odd constant).
_TOKEN_STRIDE = 0xD6E8FEB86659FD93


def gumbel_keys(seeds: int | Sequence[int] | np.ndarray,
                positions: int | Sequence[int] | np.ndarray) -> np.ndarray:  # uint64, broadcast shape
    """One 64-bit key per (seed, position): the coupled sampler's noise at that position derives
    from it alone (`gumbel_noise`)."""
    s, p = np.broadcast_arrays(_as_u64(seeds), _as_u64(positions))
    with np.errstate(over="ignore"):
        z = _mix64_array(s ^ _U64(0xD1B54A32D192ED03))
        z = _mix64_array(z ^ (p * _U64(0x9E3779B97F4A7C15)))
        salt = (int(Purpose.GUMBEL) << 32) * 0xC2B2AE3D27D4EB4F & MASK64
        return _mix64_array(z ^ _U64(salt))


def gumbel_noise_reference(keys: np.ndarray, vocab: int) -> np.ndarray:  # [n, vocab] float64
    """`gumbel_noise` in numpy (the specification; the tests hold the torch version to it bit for bit)."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64).reshape(-1, 1) ^ (np.arange(vocab, dtype=np.uint64) * _U64(_TOKEN_STRIDE))
        z = _mix64_array(z)
    u = ((z >> _U64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1): finite noise
    return -np.log(-np.log(u))


# splitmix64's constants as signed 64-bit integers: torch has no unsigned 64-bit arithmetic, and
# int64 multiplication wraps modulo 2**64 like uint64's. Right shifts of int64 copy the sign bit, so
# each shift is masked to its low bits (a logical shift).
def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_M1, _M2, _STRIDE = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(_TOKEN_STRIDE)


def _shr(z, bits: int):
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def gumbel_noise(key: int, vocab: int, device=None):  # -> [vocab] float64
    """Standard Gumbel noise for one key (`gumbel_keys`) and every token id, on `device`.

    Element v is -log(-log(u)) for u = ((splitmix64(key ^ v * stride) >> 11) + 1/2) / 2**53: the
    bits of u are `gumbel_noise_reference`'s exactly on any device; the logarithms agree to the
    last bit or two. One row at a time, so a row's noise never depends on what else is computed.
    """
    import torch

    z = torch.arange(vocab, dtype=torch.int64, device=device) * _STRIDE ^ _signed(int(key) & MASK64)
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 11).double() + 0.5) * (1.0 / (1 << 53))
    return -torch.log(-torch.log(u))

"""The KV pool: one preallocated K and one V tensor per layer, handed out to sessions in blocks.

Layout per layer: [num_slots, kv_heads, head_dim] with num_slots = num_blocks *
block_size. A session owns a list of blocks (its block table); position p of
the session lives in slot blocks[p // block_size] * block_size + p % block_size.
Cropping to an absolute length is arithmetic: lower the length and return the
blocks past it to the free list (gpt-fast's cursor, vLLM's block table).

Slot 0 (in block 0, never handed out) is the scratch slot: filler tokens write
their K/V there and padded attention rows read it, always masked out.

Sizing: the pool is `budget_bytes` big (--cache-budget-mb), or on a GPU what
the device has free after loading, whichever is smaller; torch.empty on a CPU
reserves address space only, pages are touched as blocks are first written.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.runtime.errors import ResourceExhausted

BLOCK_SIZE = 16


class PoolExhausted(ResourceExhausted):
    """No free block left for a session (after evicting every other idle session)."""


class KVPool:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, budget_bytes: int, block_size: int = BLOCK_SIZE):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.block_size = dtype, device, block_size
        element = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = 2 * num_layers * block_size * kv_heads * head_dim * element
        self.num_blocks = max(2, int(budget_bytes // self.block_bytes) + 1)  # + the scratch block
        slots = self.num_blocks * block_size
        self.keys = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)
                       for _ in range(num_layers)]
        for layer in range(num_layers):  # the scratch slot holds finite numbers
            self.keys[layer][:block_size].zero_()
            self.values[layer][:block_size].zero_()
        self._free = list(range(self.num_blocks - 1, 0, -1))  # a stack; block 0 is scratch

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"KV pool full: {n} more blocks wanted, {len(self._free)} free "
                                f"of {self.num_blocks - 1} ({self.block_size} tokens each)")
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def new_session(self) -> "SessionKV":
        return SessionKV(self)


class SessionKV:
    """One session's share of the pool: its block table and how many positions are filled."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0

    def reserve(self, total: int) -> None:
        """Own enough blocks for `total` positions (raises PoolExhausted, owning what it had)."""
        need = -(-total // self.pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.pool.allocate(need))

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (absolute); blocks past them go back to the pool."""
        self.length = min(self.length, length)
        needed = -(-self.length // self.pool.block_size)
        if needed < len(self.blocks):
            self.pool.release(self.blocks[needed:])
            del self.blocks[needed:]

    def free(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []
        self.length = 0

    def copy_prefix(self, source: "SessionKV", length: int) -> None:
        """Hold a copy of `source`'s first `length` positions (this session must be empty)."""
        self.reserve(length)
        if length:
            device = self.pool.device
            src = torch.tensor(source.slots(0, length), dtype=torch.long).to(device)
            dst = torch.tensor(self.slots(0, length), dtype=torch.long).to(device)
            for store in (*self.pool.keys, *self.pool.values):
                store.index_copy_(0, dst, store.index_select(0, src))
        self.length = length

    def move(self, sources: Sequence[int], start: int) -> None:
        """Copy the K/V at positions `sources` to positions start, start + 1, ... (a tree's path)."""
        if sources:
            device = self.pool.device
            src = torch.tensor([self.slots(p, 1)[0] for p in sources], dtype=torch.long).to(device)
            dst = torch.tensor(self.slots(start, len(sources)), dtype=torch.long).to(device)
            for store in (*self.pool.keys, *self.pool.values):
                store.index_copy_(0, dst, store.index_select(0, src))

    def slots(self, start: int, n: int) -> list[int]:
        """Pool slots of positions start .. start + n - 1 (blocks must be reserved)."""
        bs, blocks = self.pool.block_size, self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes

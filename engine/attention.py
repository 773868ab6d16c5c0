"""Attention of a packed forward over the KV pool: one SDPA call per group of rows.

A forward packs the new tokens of R sessions into T = sum(n_i) tokens. Rows
are grouped by how many queries they bring: one-token rows (decode steps, the
common case) in one group, rows of 2 to 16 tokens (Score with k + 1 drafts) in
another, longer rows (prefill chunks) in a third. Within a group every row is
padded to the group's query count and key length, the keys and values of all
its rows are gathered from the pool in one index_select each, and ONE
`scaled_dot_product_attention` call with a boolean mask does the rest.

Batch invariance (measured on two CPUs, fp32, GQA): SDPA's result for a row
does not depend on the other rows of its call, but it does depend on the
padded shapes. One-query rows keep their bits for any key length that is a
multiple of 16, so their group pads to the longest row, rounded up to 16.
Rows of several queries keep them only for the same padded key length and
the same padded query count: on one CPU (Intel, AMX) any query padding that
leaves no block of one or two queries gave the same bits, on another (AMD
EPYC, AVX-512) every query padding changed them. So such a row is grouped by
a power-of-two key bucket of its own (at least 64) AND by a query count of
its own (`query_rows(n)`: n up to 16 tokens, a Score of k + 1; longer rows,
prefill chunks, rounded up to a multiple of 32, the kernel's query block). A
row's group and padded shape therefore depend only on its own length and
query count, never on its neighbours. The number of attention operations per
layer is the number of groups (one for a batch of decode steps, one more for
the Scores of one k), not the number of sessions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.pool import KVPool, SessionKV

# Query-count classes: a row joins the first class whose bound holds its tokens.
GROUP_BOUNDS = (1, 16, 1 << 30)
ONE_QUERY_ALIGN = 16  # one-query rows: key length padded to a multiple of this
MIN_KEY_BUCKET = 64  # rows of several queries: key length padded to a power of two >= this


QUERY_BLOCK = 32  # SDPA's CPU kernel splits queries in blocks of this (for fewer than 192)


def query_rows(n: int) -> int:
    """Queries a row of n > 1 new tokens is padded to, a function of n alone (see the module doc)."""
    if n <= GROUP_BOUNDS[1]:
        return n
    return -(-n // QUERY_BLOCK) * QUERY_BLOCK


def key_bucket(length: int) -> int:
    """The padded key length of a row of several queries."""
    bucket = MIN_KEY_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


@dataclass
class Group:
    """Rows of one query class in one forward, with everything the layers reuse."""

    tq: int  # queries per row (padded)
    size: int  # rows
    identity: bool  # one query per row and the rows are exactly the packed tokens, in order
    q_index: torch.Tensor | None  # [size * tq] packed token of each (row, query); T = the zero query (padding)
    real_src: torch.Tensor | None  # [n_real] flat (row, query) index of each real query
    real_dst: torch.Tensor | None  # [n_real] its packed token index
    kv_index: torch.Tensor  # [size * length] pool slot of each (row, key); 0 = scratch
    length: int  # keys per row (padded)
    mask: torch.Tensor  # [size, 1, tq, length] bool: True = attend


@dataclass
class AttentionPlan:
    """Per forward: where each new token's K/V goes, and the groups."""

    write_slots: torch.Tensor  # [T_padded] pool slot of each packed token (filler -> 0)
    groups: list[Group]
    tokens: int  # T_padded


def plan_attention(pool: KVPool, rows: Sequence[tuple[SessionKV, int, int]], padded_tokens: int,
                   device: torch.device) -> AttentionPlan:
    """rows: (session KV, past positions, new tokens) in packing order; blocks already reserved."""
    write: list[int] = []
    members: dict[tuple[int, int], list[int]] = {}
    starts = []
    at = 0
    for r, (kv, past, n) in enumerate(rows):
        write.extend(kv.slots(past, n))
        starts.append(at)
        at += n
        query_class = next(i for i, bound in enumerate(GROUP_BOUNDS) if n <= bound)
        bucket = 0 if n == 1 else key_bucket(past + n)
        members.setdefault((query_class, bucket, 1 if n == 1 else query_rows(n)), []).append(r)
    write.extend([0] * (padded_tokens - at))
    groups = []
    bs = pool.block_size
    for (_, bucket, tq), member in sorted(members.items()):
        longest = max(rows[r][1] + rows[r][2] for r in member)
        length = bucket or -(-longest // ONE_QUERY_ALIGN) * ONE_QUERY_ALIGN
        size = len(member)
        # Every row one token and no filler: the group is the packed tokens themselves, in order.
        identity = tq == 1 and size == len(rows) == padded_tokens
        q_index = real_src = real_dst = None
        if not identity:
            q_list, src, dst = [], [], []
            for g, r in enumerate(member):
                n = rows[r][2]
                q_list.extend(range(starts[r], starts[r] + n))
                q_list.extend([padded_tokens] * (tq - n))
                src.extend(range(g * tq, g * tq + n))
                dst.extend(range(starts[r], starts[r] + n))
            q_index = torch.tensor(q_list, dtype=torch.long).to(device, non_blocking=True)
            real_src = torch.tensor(src, dtype=torch.long).to(device, non_blocking=True)
            real_dst = torch.tensor(dst, dtype=torch.long).to(device, non_blocking=True)
        nb = -(-length // bs)
        table_rows, lengths, pasts = [], [], []
        for r in member:
            kv, past, n = rows[r]
            used = -(-(past + n) // bs)
            table_rows.append(kv.blocks[:used] + [0] * (nb - used))
            lengths.append(past + n)
            pasts.append(past)
        table = torch.tensor(table_rows, dtype=torch.long)
        table = table.to(device, non_blocking=True)
        lengths_t = torch.tensor(lengths, dtype=torch.long).to(device, non_blocking=True)
        pasts_t = torch.tensor(pasts, dtype=torch.long).to(device, non_blocking=True)
        pos = torch.arange(length, device=device)  # [length]
        slots = table[:, pos // bs] * bs + pos % bs  # [size, length]
        valid = pos[None, :] < lengths_t[:, None]  # [size, length]
        kv_index = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
        # Query i of a row sits at absolute position past + i; padded queries see key 0 only.
        qpos = torch.minimum(pasts_t[:, None] + torch.arange(tq, device=device)[None, :],
                             lengths_t[:, None] - 1)  # [size, tq]
        mask = (pos[None, None, :] <= qpos[:, :, None])[:, None]  # [size, 1, tq, length]
        groups.append(Group(tq, size, identity, q_index, real_src, real_dst, kv_index, length, mask))
    write_t = torch.tensor(write, dtype=torch.long).to(device, non_blocking=True)
    return AttentionPlan(write_t, groups, padded_tokens)


def attend(pool: KVPool, layer: int, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [T, heads, hd], k, v [T, kv_heads, hd] (rotated) -> [T, heads * hd]; writes k, v to the pool."""
    keys, values = pool.keys[layer], pool.values[layer]  # [slots, kv_heads, hd]
    keys.index_copy_(0, plan.write_slots, k)
    values.index_copy_(0, plan.write_slots, v)
    t, heads, hd = q.shape
    kvh = k.shape[1]
    out = None
    for group in plan.groups:
        gk = keys.index_select(0, group.kv_index).view(group.size, group.length, kvh, hd).transpose(1, 2)
        gv = values.index_select(0, group.kv_index).view(group.size, group.length, kvh, hd).transpose(1, 2)
        if group.identity:
            gq = q.view(group.size, 1, heads, hd).transpose(1, 2)  # [size, heads, 1, hd]
        else:
            padded = torch.cat([q, q.new_zeros(1, heads, hd)])  # index T: the zero query of padding
            gq = padded.index_select(0, group.q_index).view(group.size, group.tq, heads, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=group.mask, scale=scaling,
                                           enable_gqa=heads != kvh)  # [size, heads, tq, hd]
        o = o.transpose(1, 2).reshape(group.size * group.tq, heads * hd)
        if group.identity:
            return o
        if out is None:
            out = q.new_zeros(t, heads * hd)  # filler tokens keep zeros
        out.index_copy_(0, group.real_dst, o.index_select(0, group.real_src))
    assert out is not None
    return out

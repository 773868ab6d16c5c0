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
multiple of 16, so a group of them pads to its longest row, rounded up to 16.
They are split by length (`one_query_lengths`): every key a row is padded to
is gathered from the pool and attended to in every layer, so one long row
among short ones would make every row cost the long one (64 decode rows of
which 9 hold 300-400 tokens cost 14 ms a forward on the tiny test model,
against 2 ms for the 32 short ones alone). A group costs a few operations
per layer of its own, so a class of short rows joins the next longer one
when the padding that adds is small.
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
from engine.tree import TreeRow

# Query-count classes: a row joins the first class whose bound holds its tokens.
GROUP_BOUNDS = (1, 16, 1 << 30)
ONE_QUERY_ALIGN = 16  # one-query rows: key length padded to a multiple of this
# What one more group of one-query rows costs per layer (its gathers, SDPA call and scatter), in
# padded keys: a class of rows joins the next longer one when that pads fewer keys than this.
ONE_QUERY_GROUP_KEYS = 512
MIN_KEY_BUCKET = 64  # rows of several queries: key length padded to a power of two >= this


QUERY_BLOCK = 32  # SDPA's CPU kernel splits queries in blocks of this (for fewer than 192)


def query_rows(n: int) -> int:
    """Queries a row of n > 1 new tokens is padded to, a function of n alone (see the module doc)."""
    if n <= GROUP_BOUNDS[1]:
        return n
    return -(-n // QUERY_BLOCK) * QUERY_BLOCK


def _query_class(n: int) -> int:
    """The query-count class of a row of n tokens: the first GROUP_BOUNDS entry that holds n."""
    return next(i for i, bound in enumerate(GROUP_BOUNDS) if n <= bound)


def key_bucket(length: int) -> int:
    """The padded key length of a row of several queries."""
    bucket = MIN_KEY_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


def one_query_lengths(lengths: Sequence[int]) -> list[int]:
    """The padded key length of each one-query row of a forward, given every such row's keys.

    Rows fall in power-of-two classes of their length (the smallest class holds
    up to MIN_KEY_BUCKET); a class pads to its longest row rounded up to
    ONE_QUERY_ALIGN. From the shortest up, a class joins the next one when its
    rows' extra padding would be at most ONE_QUERY_GROUP_KEYS.
    """
    aligned = [-(-n // ONE_QUERY_ALIGN) * ONE_QUERY_ALIGN for n in lengths]
    row_class = [key_bucket(n) for n in aligned]
    longest: dict[int, int] = {}  # class -> its longest aligned row
    size: dict[int, int] = {}
    for c, n in zip(row_class, aligned):
        longest[c] = max(longest.get(c, 0), n)
        size[c] = size.get(c, 0) + 1
    classes = sorted(longest)
    padded: dict[int, int] = {}  # class -> the length its rows pad to
    joined: list[int] = []  # classes merged into the one being considered
    rows = 0  # their rows
    for i, c in enumerate(classes):
        joined.append(c)
        rows += size[c]
        if i + 1 < len(classes) and rows * (longest[classes[i + 1]] - longest[c]) <= ONE_QUERY_GROUP_KEYS:
            continue  # cheaper padded along with the next class than as a group of its own
        padded.update((j, longest[c]) for j in joined)
        joined, rows = [], 0
    return [padded[c] for c in row_class]


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


def plan_attention(pool: KVPool, rows: Sequence[tuple[SessionKV, int, int, TreeRow | None]], padded_tokens: int,
                   device: torch.device) -> AttentionPlan:
    """rows: (session KV, past positions, new tokens, tree or None) in packing order; blocks already
    reserved. A tree row (engine.tree) always gets a mask of its own: its nodes see the held prefix
    and their own ancestors, not the positions in between."""
    write: list[int] = []
    members: dict[tuple[int, int, int], list[int]] = {}
    starts = []
    at = 0
    bs = pool.block_size
    singles = iter(one_query_lengths([past + 1 for _, past, n, tree in rows if n == 1 and tree is None]))
    # Per row: its KV's slots and its group. A decode row (one token, the common case; class 0)
    # is spelled out: this loop runs over every row of every forward.
    for r, (kv, past, n, tree) in enumerate(rows):
        starts.append(at)
        at += n
        if n == 1 and tree is None:
            write.append(kv.blocks[past // bs] * bs + past % bs)
            key = (0, next(singles), 1)
        else:
            write.extend(kv.slots(past, n))
            q = max(n, 2) if tree is not None else n  # a tree's one-node step still needs its mask
            key = (_query_class(q), key_bucket(past + n), query_rows(q))
        group = members.get(key)
        if group is None:
            members[key] = [r]
        else:
            group.append(r)
    write.extend([0] * (padded_tokens - at))
    groups = []
    for (_, bucket, tq), member in sorted(members.items()):
        length = bucket  # one-query rows: their group's (one_query_lengths); else the key bucket
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
            kv, past, n, _ = rows[r]
            used = -(-(past + n) // bs)
            table_rows.append(kv.blocks[:used] + [0] * (nb - used))
            lengths.append(past + n)
            pasts.append(past)
        table = torch.tensor(table_rows, dtype=torch.long)
        table = table.to(device, non_blocking=True)
        lengths_t = torch.tensor(lengths, dtype=torch.long).to(device, non_blocking=True)
        pos = torch.arange(length, device=device)  # [length]
        slots = table[:, pos // bs] * bs + pos % bs  # [size, length]
        valid = pos[None, :] < lengths_t[:, None]  # [size, length]
        kv_index = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
        if tq == 1:  # one query at position length - 1: it sees exactly the valid keys
            mask = valid[:, None, None, :]  # [size, 1, 1, length]
        else:
            # Query i of a row sits at absolute position past + i; padded queries see key 0 only.
            pasts_t = torch.tensor(pasts, dtype=torch.long).to(device, non_blocking=True)
            qpos = torch.minimum(pasts_t[:, None] + torch.arange(tq, device=device)[None, :],
                                 lengths_t[:, None] - 1)  # [size, tq]
            mask = (pos[None, None, :] <= qpos[:, :, None])[:, None]  # [size, 1, tq, length]
            if any(rows[r][3] is not None for r in member):
                mask = _tree_masks(mask, [rows[r][3] for r in member], length).to(device, non_blocking=True)
        groups.append(Group(tq, size, identity, q_index, real_src, real_dst, kv_index, length, mask))
    write_t = torch.tensor(write, dtype=torch.long).to(device, non_blocking=True)
    return AttentionPlan(write_t, groups, padded_tokens)


def _tree_masks(mask: torch.Tensor, trees: Sequence[TreeRow | None], length: int) -> torch.Tensor:
    """The group's causal masks ([size, 1, tq, length]) with each tree node's row replaced: the
    held prefix (keys below its tree's base) and the storage positions of its path."""
    mask = mask.cpu().clone()
    keys = torch.arange(length)
    for g, tree in enumerate(trees):
        if tree is None:
            continue
        for j, seen in enumerate(tree.sees):
            row = keys < tree.base
            row[torch.tensor(seen, dtype=torch.long)] = True
            mask[g, 0, tree.first + j] = row
    return mask


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

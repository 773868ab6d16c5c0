"""Attention of a packed forward over the KV pool: every query computed as a decode step's is.

Exactness rests on one rule: a position's logits do not depend on how many
tokens, rows or tree nodes share its forward. Attention is where that broke:
SDPA's result for a query depends on how many other queries its call holds
(measured on an AMD EPYC, SmolLM2-135M: a Score of k + 1 tokens against one
token at a time gave bitwise different logits at almost every position, in
bfloat16 AND float32; bf16 flipped 1 argmax in 15, fp32 none in 250 only by
the margin). So every new token is a *lane*: one query, attending to its own
keys in logical order, exactly the call a one-token decode makes:

  * a chain token at position p: the keys of positions 0..p;
  * a token-tree node: the held prefix, then its ancestors by depth, then itself
    (gathered in that order, so it computes what the chain along its path does,
    never a masked key between two of its own);
  * a long row (a prefill chunk of more than SHARED_FROM tokens) gathers its
    keys once and hands each block of LANE_BLOCK lanes the prefix its last lane
    needs, expanded without a copy, each lane masked to its own position;
  * a Score row (2 .. SHARED_FROM - 1 chain tokens) also gathers its keys once:
    its lanes are folded into SDPA's head axis (n lanes x the query heads of one
    KV head share that KV head, each (lane, head) masked to the lane's
    position), and rows of the same n and padded length share one call.

One-query SDPA (measured on the same CPU, bf16, fp16 and fp32, 1 and 2 threads): a query's output
is bitwise the same for any number of other lanes in the call, for any key padding that is a
multiple of ONE_QUERY_ALIGN with the padding masked, and folded into the head axis as above (each
(row, head) is its own one-query product; the start-up check proves it on the device, and where it
holds on 1 thread only runs the SDPA calls on one: `AttentionPlan.threads`). So lanes are grouped
by padded key length only (`one_query_lengths`), whoever they belong to.

Where exactness is switched off (--no-batch-invariant), every row of several tokens is one
SDPA call over all its queries instead (`multi_query`): faster for long prefills, but a query's
rounding then follows how many share its call.

The attention's compute dtype (`compute`): on a CPU float32 whatever the weights
(bf16 one-query SDPA measured 3-4x slower than upcasting K/V to fp32, and fp32 is
exact as well); on a GPU the weights' dtype, with float32 the fallback the start-up
check (engine.selfcheck) takes if that is not invariant there. A sliding-window layer
masks each lane's keys before its last `window` too (every lane's mask is a prefix of
its logical positions): the same calls and shapes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.pool import KVPool, SessionKV
from engine.tree import TreeRow

ONE_QUERY_ALIGN = 16  # a lane's key length is padded to a multiple of this
# What one more group of lanes costs per layer (its gathers, SDPA call and scatter), in padded
# keys: a class of lanes joins the next longer one when that pads fewer keys than this.
ONE_QUERY_GROUP_KEYS = 512
MIN_KEY_BUCKET = 64  # the shortest class of lane lengths (powers of two from here)
SHARED_FROM = 17  # a chain row of at least this many tokens gathers its keys once for all its lanes
LANE_BLOCK = 64  # lanes of such a row per SDPA call (bounds the expanded keys)


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The default compute dtype of attention for weights of `dtype` on `device` (see the module doc)."""
    return torch.float32 if device.type == "cpu" else dtype


def _aligned(n: int) -> int:
    return -(-n // ONE_QUERY_ALIGN) * ONE_QUERY_ALIGN


def key_bucket(length: int) -> int:
    """The power-of-two class (at least MIN_KEY_BUCKET) of a lane's key length."""
    bucket = MIN_KEY_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


def one_query_lengths(lengths: Sequence[int]) -> list[int]:
    """The padded key length of each lane of a forward, given every lane's keys.

    Lanes fall in power-of-two classes of their length (the smallest class holds
    up to MIN_KEY_BUCKET); a class pads to its longest lane rounded up to
    ONE_QUERY_ALIGN. From the shortest up, a class joins the next one when its
    lanes' extra padding would be at most ONE_QUERY_GROUP_KEYS.
    """
    aligned = [_aligned(n) for n in lengths]
    row_class = [key_bucket(n) for n in aligned]
    longest: dict[int, int] = {}  # class -> its longest aligned lane
    size: dict[int, int] = {}
    for c, n in zip(row_class, aligned):
        longest[c] = max(longest.get(c, 0), n)
        size[c] = size.get(c, 0) + 1
    classes = sorted(longest)
    padded: dict[int, int] = {}  # class -> the length its lanes pad to
    joined: list[int] = []  # classes merged into the one being considered
    rows = 0  # their lanes
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
    """Lanes (one query each) of one SDPA call, with everything the layers reuse."""

    size: int  # lanes
    length: int  # keys per lane (padded)
    identity: bool  # the lanes are exactly the packed tokens, in order
    q_index: torch.Tensor | None  # [size] packed token of each lane (None: identity)
    kv_index: torch.Tensor  # [size * length] pool slot of each (lane, key), or [length] if shared; 0 = scratch
    shared: bool  # every lane reads the same keys (one long row's block), masked to its own position
    mask: torch.Tensor  # [size, 1, 1, length] bool: True = attend; folded: [size, fold, length] per lane
    fold: int = 0  # > 0: `size` Score rows of `fold` lanes each, folded into the head axis (q_index row-major)
    head_mask: torch.Tensor | None = None  # folded: the mask per (row, query head), made at the first layer
    windowed: dict | None = None  # (window, skip_first) -> (mask, head_mask), made at the first layer asking

    def masks(self, window: int | None, skip_first: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mask, folded head mask) for a layer of that window (None: every earlier key); skip_first:
        key 0 masked for every lane but position 0's own (an EAGLE-3 head, which never reads position 0)."""
        if window is None and not skip_first:
            return self.mask, self.head_mask
        self.windowed = self.windowed if self.windowed is not None else {}
        if (window, skip_first) not in self.windowed:
            keys = self.mask.sum(-1, keepdim=True)  # a lane's key count: its mask is a prefix
            at = torch.arange(self.length, device=self.mask.device)
            mask = self.mask if window is None else self.mask & (at >= keys - window)
            if skip_first:
                mask = mask & ((at >= 1) | (keys == 1))
            self.windowed[(window, skip_first)] = (mask, None)
        return self.windowed[(window, skip_first)]


@dataclass
class AttentionPlan:
    """Per forward: where each new token's K/V goes, and the lane groups."""

    write_slots: torch.Tensor  # [T_padded] pool slot of each packed token (filler -> 0)
    groups: list[Group]
    tokens: int  # T_padded
    compute: torch.dtype  # attention's compute dtype
    multi_query: bool = False  # a shared group is one call over all its queries (not exact; module doc)
    threads: int = 0  # CPU threads of its SDPA calls (0: the process's; see the module doc)


def _lane_positions(past: int, n: int, tree: TreeRow | None) -> list[tuple[int, list[int] | None]]:
    """Per token of a row: (its key count, its tree keys above the tree's base or None for a chain)."""
    if tree is None:
        return [(past + i + 1, None) for i in range(n)]
    chain = [(past + i + 1, None) for i in range(tree.first)]
    return chain + [(tree.base + len(seen), seen) for seen in tree.sees]


def plan_attention(pool: KVPool, rows: Sequence[tuple[SessionKV, int, int, TreeRow | None]], padded_tokens: int,
                   device: torch.device, compute: torch.dtype | None = None, *,
                   multi_query: bool = False, threads: int = 0) -> AttentionPlan:
    """rows: (session KV, past positions, new tokens, tree or None) in packing order; blocks already
    reserved. Every token becomes a lane (see the module doc); with multi_query, every chain row of
    several tokens is one call over its queries instead."""
    bs = pool.block_size
    write: list[int] = []
    lane_row: list[int] = []  # per short lane: its row
    lane_token: list[int] = []  # its packed token index
    lane_keys: list[int] = []  # its key count
    lane_tree: list[list[int] | None] = []  # a tree node's keys above its base
    shared: list[tuple[int, int, int]] = []  # long rows: (row, first packed token, n)
    scores: dict[int, list[tuple[int, int]]] = {}  # Score rows by n: (row, first packed token)
    at = 0
    for r, (kv, past, n, tree) in enumerate(rows):
        if n == 1 and tree is None:  # a decode step, the common case, spelled out
            write.append(kv.blocks[past // bs] * bs + past % bs)
            lane_row.append(r)
            lane_token.append(at)
            lane_keys.append(past + 1)
            lane_tree.append(None)
        else:
            write.extend(kv.slots(past, n))
            if tree is None and (n >= SHARED_FROM or multi_query):
                shared.append((r, at, n))
            elif tree is None:
                scores.setdefault(n, []).append((r, at))
            else:
                for i, (keys, seen) in enumerate(_lane_positions(past, n, tree)):
                    lane_row.append(r)
                    lane_token.append(at + i)
                    lane_keys.append(keys)
                    lane_tree.append(seen)
        at += n
    write.extend([0] * (padded_tokens - at))
    groups: list[Group] = []
    if lane_row:
        members: dict[int, list[int]] = {}
        for lane, length in enumerate(one_query_lengths(lane_keys)):
            members.setdefault(length, []).append(lane)
        for length, lanes in sorted(members.items()):
            identity = (len(members) == 1 and not shared and not scores and len(lanes) == padded_tokens
                        and lane_token == list(range(padded_tokens)))
            groups.append(_lane_group(rows, lanes, lane_row, lane_token, lane_keys, lane_tree, length, identity,
                                      bs, device))
    for n, members_n in sorted(scores.items()):
        by_length: dict[int, list[tuple[int, int]]] = {}
        for member, length in zip(members_n, one_query_lengths([rows[r][1] + n for r, _ in members_n])):
            by_length.setdefault(length, []).append(member)
        for length, folded in sorted(by_length.items()):
            groups.append(_folded_group(rows, folded, n, length, bs, device))
    for r, first, n in shared:
        kv, past, _, _ = rows[r]
        block = n if multi_query else LANE_BLOCK
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            length = _aligned(past + hi)
            pos = torch.arange(length)
            slots = _slots(kv.blocks, pos, past + hi, bs)
            ends = torch.arange(past + lo + 1, past + hi + 1)  # each lane's key count
            mask = (pos[None, :] < ends[:, None])[:, None, None, :]
            groups.append(Group(hi - lo, length, False,
                                torch.arange(first + lo, first + hi).to(device, non_blocking=True),
                                slots.to(device, non_blocking=True), True, mask.to(device, non_blocking=True)))
    write_t = torch.tensor(write, dtype=torch.long).to(device, non_blocking=True)
    dtype = compute if compute is not None else (pool.keys[0].dtype if pool.keys else torch.float32)
    return AttentionPlan(write_t, groups, padded_tokens, dtype, multi_query, threads)


def _padded(blocks: Sequence[int], width: int) -> list[int]:
    return list(blocks[:width]) + [0] * (width - min(width, len(blocks)))


def _slots(blocks: Sequence[int], pos: torch.Tensor, valid: int, bs: int) -> torch.Tensor:
    """Pool slots of a session's logical positions `pos` (those >= valid: the scratch slot 0)."""
    table = torch.tensor(_padded(blocks, int(pos.max()) // bs + 1), dtype=torch.long)
    slots = table[pos // bs] * bs + pos % bs
    return torch.where(pos < valid, slots, torch.zeros_like(slots))


def _folded_group(rows, folded: list[tuple[int, int]], n: int, length: int, bs: int,
                  device: torch.device) -> Group:
    """Score rows of n chain tokens and one padded key length: each row's keys gathered once."""
    width = -(-length // bs)
    table = torch.tensor([_padded(rows[r][0].blocks, width) for r, _ in folded], dtype=torch.long)  # [rows, width]
    pos = torch.arange(length)
    slots = table[:, pos // bs] * bs + pos % bs  # [rows, length]
    pasts = torch.tensor([rows[r][1] for r, _ in folded], dtype=torch.long)
    valid = pos[None, :] < (pasts + n)[:, None]  # [rows, length]
    kv_index = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
    ends = pasts[:, None] + torch.arange(1, n + 1)[None, :]  # [rows, n] each lane's key count
    mask = pos[None, None, :] < ends[:, :, None]  # [rows, n, length]
    q_index = torch.tensor([first + i for _, first in folded for i in range(n)], dtype=torch.long)
    return Group(len(folded), length, False, q_index.to(device, non_blocking=True),
                 kv_index.to(device, non_blocking=True), False, mask.to(device, non_blocking=True), fold=n)


def _lane_group(rows, lanes: list[int], lane_row: list[int], lane_token: list[int], lane_keys: list[int],
                lane_tree: list[list[int] | None], length: int, identity: bool, bs: int,
                device: torch.device) -> Group:
    """One SDPA call's lanes, each with its own keys gathered in logical order."""
    size = len(lanes)
    width = -(-length // bs)
    trees = [g for g, lane in enumerate(lanes) if lane_tree[lane] is not None]
    if trees:  # a tree node: after the prefix, its ancestors' and its own storage positions
        pos = torch.arange(length).repeat(size, 1)  # [size, length] logical key -> storage position
        for g in trees:
            seen = lane_tree[lanes[g]]
            base = lane_keys[lanes[g]] - len(seen)
            pos[g, base:base + len(seen)] = torch.tensor(seen, dtype=torch.long)
            width = max(width, max(seen) // bs + 1)
    else:
        pos = torch.arange(length).expand(size, -1)
    table = torch.tensor([_padded(rows[lane_row[lane]][0].blocks, width) for lane in lanes],
                         dtype=torch.long)  # [size, width]
    slots = table.gather(1, pos // bs) * bs + pos % bs  # [size, length]
    lengths = torch.tensor([lane_keys[lane] for lane in lanes], dtype=torch.long)
    valid = torch.arange(length)[None, :] < lengths[:, None]  # [size, length]
    kv_index = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
    q_index = None if identity else torch.tensor([lane_token[lane] for lane in lanes], dtype=torch.long)
    return Group(size, length, identity,
                 q_index.to(device, non_blocking=True) if q_index is not None else None,
                 kv_index.to(device, non_blocking=True), False, valid[:, None, None, :].to(device, non_blocking=True))


def attend(pool: KVPool, layer: int, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, scaling: float, window: int | None = None, skip_first: bool = False) -> torch.Tensor:
    """q [T, heads, hd], k, v [T, kv_heads, hd] (rotated) -> [T, heads * hd]; writes k, v to the pool.
    window: a sliding-window layer's (each lane attends to its last `window` keys); skip_first: no
    lane past position 0 attends to key 0 (Group.masks)."""
    threads = torch.get_num_threads()
    if not plan.threads or plan.threads == threads:
        return _attend(pool, layer, plan, q, k, v, scaling, (window, skip_first))
    torch.set_num_threads(plan.threads)  # ~0.3 µs a switch on a CPU
    try:
        return _attend(pool, layer, plan, q, k, v, scaling, (window, skip_first))
    finally:
        torch.set_num_threads(threads)


def _attend(pool: KVPool, layer: int, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, scaling: float, mode: tuple) -> torch.Tensor:
    keys, values = pool.keys[layer], pool.values[layer]  # [slots, kv_heads, hd]
    keys.index_copy_(0, plan.write_slots, k)
    values.index_copy_(0, plan.write_slots, v)
    t, heads, hd = q.shape
    kvh = k.shape[1]
    compute = plan.compute
    out = None
    for group in plan.groups:
        if group.shared and plan.multi_query:
            out = _multi_query(keys, values, group, q, out, scaling, compute, mode)
            continue
        if group.fold:
            out = _folded(keys, values, group, q, out, scaling, compute, mode)
            continue
        rows = 1 if group.shared else group.size
        gk = keys.index_select(0, group.kv_index).to(compute).view(rows, group.length, kvh, hd).transpose(1, 2)
        gv = values.index_select(0, group.kv_index).to(compute).view(rows, group.length, kvh, hd).transpose(1, 2)
        if group.shared:
            gk, gv = gk.expand(group.size, -1, -1, -1), gv.expand(group.size, -1, -1, -1)
        gq = q if group.identity else q.index_select(0, group.q_index)
        gq = gq.to(compute).unsqueeze(2)  # [size, heads, 1, hd]
        o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=group.masks(*mode)[0], scale=scaling,
                                           enable_gqa=heads != kvh)  # [size, heads, 1, hd]
        o = o.reshape(group.size, heads * hd).to(q.dtype)
        if group.identity:
            return o
        if out is None:
            out = q.new_zeros(t, heads * hd)  # filler tokens keep zeros
        out.index_copy_(0, group.q_index, o)
    assert out is not None
    return out


def _multi_query(keys: torch.Tensor, values: torch.Tensor, group: Group, q: torch.Tensor, out: torch.Tensor | None,
                 scaling: float, compute: torch.dtype, mode: tuple = (None, False)) -> torch.Tensor:
    """A shared group as ONE SDPA call over all its queries (--no-batch-invariant)."""
    t, heads, hd = q.shape
    kvh = keys.shape[1]
    gk = keys.index_select(0, group.kv_index).to(compute).view(1, group.length, kvh, hd).transpose(1, 2)
    gv = values.index_select(0, group.kv_index).to(compute).view(1, group.length, kvh, hd).transpose(1, 2)
    gq = q.index_select(0, group.q_index).to(compute).transpose(0, 1)[None]  # [1, heads, size, hd]
    o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=group.masks(*mode)[0][:, 0, 0][None, None], scale=scaling,
                                       enable_gqa=heads != kvh)  # [1, heads, size, hd]
    if out is None:
        out = q.new_zeros(t, heads * hd)
    out.index_copy_(0, group.q_index, o[0].transpose(0, 1).reshape(group.size, heads * hd).to(q.dtype))
    return out


def _folded(keys: torch.Tensor, values: torch.Tensor, group: Group, q: torch.Tensor, out: torch.Tensor | None,
            scaling: float, compute: torch.dtype, mode: tuple = (None, False)) -> torch.Tensor:
    """Score rows with their lanes in the head axis: query head (j, lane, g) reads KV head j."""
    t, heads, hd = q.shape
    kvh = keys.shape[1]
    g, n, rows = heads // kvh, group.fold, group.size
    mask, head_mask = group.masks(*mode)
    if head_mask is None:  # [rows, n, L] -> [rows, kvh * n * g, 1, L], once per forward and mode
        head_mask = mask[:, None, :, None, :].expand(rows, kvh, n, g, group.length).reshape(
            rows, kvh * n * g, 1, group.length)
        if mode == (None, False):
            group.head_mask = head_mask
        else:
            group.windowed[mode] = (mask, head_mask)
    gk = keys.index_select(0, group.kv_index).to(compute).view(rows, group.length, kvh, hd).transpose(1, 2)
    gv = values.index_select(0, group.kv_index).to(compute).view(rows, group.length, kvh, hd).transpose(1, 2)
    gq = q.index_select(0, group.q_index).to(compute).view(rows, n, kvh, g, hd).permute(0, 2, 1, 3, 4).reshape(
        rows, kvh * n * g, 1, hd)
    o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=head_mask, scale=scaling,
                                       enable_gqa=True)  # [rows, kvh * n * g, 1, hd]
    o = o.view(rows, kvh, n, g, hd).permute(0, 2, 1, 3, 4).reshape(rows * n, heads * hd).to(q.dtype)
    if out is None:
        out = q.new_zeros(t, heads * hd)
    out.index_copy_(0, group.q_index, o)
    return out

"""Row-wise packed forward: one model pass over the new tokens of several sessions.

Layout. Every session owns its KV cache (`SessionKV`: per layer a growable
[kv_heads, capacity, head_dim] K and V buffer plus a length). A forward over R
sessions with n_i new tokens each packs them into ONE row of T = sum(n_i)
tokens (input_ids [1, T], position_ids [1, T], no padding between sessions).
The model's own forward runs unchanged, so every linear layer (q/k/v/o, MLP,
LM head) runs once over all T rows. Attention is the only per-session part: the
attention function registered here as "specdec_rows" writes each session's new
K/V into that session's buffers and runs transformers' own sdpa call over that
session's exact K/V, with the same shapes as when the session runs alone.

Why not what transformers ships (measured, transformers 5.24):
  * StaticCache keeps one length counter for all rows of a batch: rows cannot
    hold different lengths nor be cropped one by one, and it preallocates the
    full context per row (~377 MB per session for SmolLM2 at 8k tokens), which
    defeats an LRU budget by bytes.
  * PagedAttentionCache / the continuous-batching manager own the generation
    loop: no crop to an absolute length, no scoring of k+1 tokens chosen by the
    caller, no full distributions, and eviction by blocks, not by sessions,
    bytes or TTL. Its full-attention allocator also gathers the whole sequence
    every layer and forward.
  * A padded batch gathering every session's KV into [B, kv_heads, Lmax, hd]
    costs as much in copies as it saves, and its shapes depend on who else is
    in the batch (so a session's bits would too).
  * A slot layout ([slots, kv_heads, max_len, hd]) needs the same gather for a
    batch of non-adjacent slots, and preallocates max_len per slot.

Batch invariance. A row's logits must not depend on what else is in the
forward. Attention is per session with exact shapes, and elementwise ops and
norms are per row; the linears are the only place where the row count M
matters: a GEMM library picks its kernel (and so its rounding) by M. On CPU
fp32 with one thread every M >= 4 gives the same bits per row, M = 1..3 do not;
with more threads, or on a GPU, other M deviate. So `calibrate` measures, at
start-up on this device, dtype and thread count, which M give the same bits as
the large-M kernels, and every forward pads its packed token count and its
kept-logit count up to the next such M (filler rows that are never cached).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

log = logging.getLogger(__name__)

ATTENTION = "specdec_rows"  # the name registered in transformers' AttentionInterface
DENSE_UP_TO = 32  # calibration tests every row count up to this, then a sample


class SessionKV:
    """One session's KV cache: per layer a [kv_heads, capacity, head_dim] K and V buffer.

    Grows by doubling (amortised copies; a DynamicCache copies the whole session
    on every forward) and crops in O(1) by lowering `length`; stale entries
    past `length` are overwritten by the next forward. `nbytes` is the
    capacity, what the LRU byte budget must count.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []

    def reserve(self, total: int) -> None:
        """Make room for `total` tokens: the exact size first, then at least doubling."""
        if total <= self.capacity:
            return
        capacity = total if self.capacity == 0 else max(total, 2 * self.capacity)
        shape = (self.kv_heads, capacity, self.head_dim)
        keys, values = [], []
        for layer in range(self.num_layers):
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if self.length:
                k[:, : self.length] = self.keys[layer][:, : self.length]
                v[:, : self.length] = self.values[layer][:, : self.length]
            keys.append(k)
            values.append(v)
        self.keys, self.values, self.capacity = keys, values, capacity

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens (absolute)."""
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.capacity * self.head_dim * element


@dataclass
class Row:
    """One session's part of a forward: feed `tokens`, return logits of the last `keep`."""

    kv: SessionKV
    tokens: Sequence[int]
    keep: int  # 0..len(tokens)


@dataclass
class _Slot:
    """Where a row sits in the packed forward (what the attention function needs)."""

    kv: SessionKV
    start: int  # offset in the packed token axis
    n: int  # new tokens
    past: int  # tokens cached before them = absolute position of the first


_MASKS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _tail_mask(n: int, total: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, total] bool: query j (absolute position total - n + j) sees keys 0..total - n + j."""
    key = (n, total, device)
    mask = _MASKS.get(key)
    if mask is None:
        queries = torch.arange(total - n, total, device=device)[:, None]
        mask = (torch.arange(total, device=device)[None, :] <= queries)[None, None]
        if len(_MASKS) > 4096:
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   specdec_rows: list[_Slot] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a packed forward, session by session.

    query [1, heads, T, hd]; key, value [1, kv_heads, T, hd] (the new tokens only,
    no cache is passed to the model); returns [1, T, heads, hd] like transformers'
    own attention functions. Filler rows (no slot) get zeros.
    """
    if specdec_rows is None:
        raise RuntimeError("the specdec_rows attention runs only inside forward_rows")
    layer = module.layer_idx
    out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])  # [1, T, heads, hd]
    for slot in specdec_rows:
        s, n, end = slot.start, slot.n, slot.past + slot.n
        k_buf, v_buf = slot.kv.keys[layer], slot.kv.values[layer]  # [kv_heads, capacity, hd]
        k_buf[:, slot.past:end] = key[0, :, s:s + n]
        v_buf[:, slot.past:end] = value[0, :, s:s + n]
        # One query sees everything; a fresh prefill is plain causal (sdpa's own
        # is_causal); otherwise the queries sit at the bottom right of the keys.
        mask = None if n == 1 or slot.past == 0 else _tail_mask(n, end, query.device)
        o, _ = sdpa_attention_forward(module, query[:, :, s:s + n], k_buf[None, :, :end],
                                      v_buf[None, :, :end], mask, dropout=0.0, scaling=scaling)
        out[:, s:s + n] = o
    return out, None


AttentionInterface.register(ATTENTION, rows_attention)


class RowPadding:
    """Row counts the linears give batch-invariant bits for; `pad(m)` is the next one."""

    def __init__(self, safe: Sequence[int], dense_above: int | None):
        self.safe = sorted(safe)  # tested row counts in the invariant class
        self.dense_above = dense_above  # every count beyond this is assumed safe (sampled), or None

    @classmethod
    def off(cls) -> RowPadding:
        """No padding at all (measurements of what the measure buys)."""
        return cls([1], 1)

    def pad(self, m: int) -> int:
        if self.dense_above is not None and m > self.dense_above:
            return m
        for safe in self.safe:
            if safe >= m:
                return safe
        return m  # beyond every tested count: not verified (never reached within the limits)

    def __repr__(self) -> str:
        dense = f", every count > {self.dense_above}" if self.dense_above is not None else ""
        return f"RowPadding({self.safe[:12]}{'...' if len(self.safe) > 12 else ''}{dense})"


def _candidates(limit: int) -> list[int]:
    """Every row count up to DENSE_UP_TO, then a geometric-ish sample up to `limit`."""
    out = list(range(1, min(limit, DENSE_UP_TO) + 1))
    m = DENSE_UP_TO
    while m < limit:
        m = min(limit, max(m + 8, int(m * 1.5)) // 8 * 8)
        out.append(m)
    return out


def _classes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: list[int]) -> list[int]:
    """Per count the id of its bitwise class: counts whose rows agree share an id."""
    reps: list[tuple[int, torch.Tensor]] = []
    ids = []
    for m in counts:
        y = fn(x[:, :m])  # [1, m, out]
        for cid, (rm, ry) in enumerate(reps):
            common = min(m, rm)
            if torch.equal(y[:, :common], ry[:, :common]):
                ids.append(cid)
                break
        else:
            reps.append((m, y))
            ids.append(len(reps) - 1)
    return ids


def calibrate(model: torch.nn.Module, max_tokens: int, max_kept: int) -> tuple[RowPadding, RowPadding]:
    """(padding of the packed token count, padding of the kept-logit count) on this device.

    Runs every distinct linear shape of the model (and the LM head) over the
    candidate row counts on the same random input; the counts whose rows all
    agree with the largest class form the safe set. Takes ~1 s for a 135M model
    on one CPU thread.
    """
    head = model.get_output_embeddings()
    param = next(model.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    body: dict[tuple, torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            body.setdefault((module.in_features, module.out_features, module.weight.dtype,
                             module.bias is not None), module)

    def safe_counts(modules: list[torch.nn.Module], in_features: list[int], limit: int) -> RowPadding:
        counts = _candidates(max(limit, 4))
        signature: dict[int, list[int]] = {m: [] for m in counts}
        for module, width in zip(modules, in_features):
            x = torch.randn(1, counts[-1], width, generator=gen).to(param.device, param.dtype)
            for m, cid in zip(counts, _classes(module, x, counts)):
                signature[m].append(cid)
        groups: dict[tuple, list[int]] = {}
        for m in counts:
            groups.setdefault(tuple(signature[m]), []).append(m)
        # The largest class wins; on a tie the one holding the largest count.
        best = max(groups.values(), key=lambda ms: (len(ms), ms[-1]))
        sampled = [m for m in counts if m > DENSE_UP_TO]
        dense = DENSE_UP_TO if sampled and all(m in best for m in sampled) else None
        return RowPadding(best, dense)

    with torch.inference_mode():
        tokens = safe_counts(list(body.values()), [key[0] for key in body], max_tokens)
        hidden = model.config.hidden_size
        kept = safe_counts([head], [hidden], max_kept)
    return tokens, kept


def new_kv(model: torch.nn.Module) -> SessionKV:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    param = next(model.parameters())
    return SessionKV(config.num_hidden_layers, config.num_key_value_heads, head_dim, param.dtype, param.device)


class RowsForward:
    """Runs packed forwards over many sessions; the model's attention must be ATTENTION."""

    max_rows = 1 << 30  # the scheduler's --max-batch is the limit

    def __init__(self, model: torch.nn.Module, tokens: RowPadding, kept: RowPadding):
        self.model = model
        self.device = next(model.parameters()).device
        self.tokens_padding = tokens
        self.kept_padding = kept

    def new_cache(self) -> SessionKV:
        return new_kv(self.model)

    def __call__(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """One forward; per row the logits of its last `keep` tokens ([keep, vocab])."""
        slots, ids, positions, kept = [], [], [], []
        start = 0
        for row in rows:
            n, past = len(row.tokens), row.kv.length
            row.kv.reserve(past + n)
            slots.append(_Slot(row.kv, start, n, past))
            ids.extend(row.tokens)
            positions.extend(range(past, past + n))
            kept.extend(range(start + n - row.keep, start + n))
            start += n
        # Filler rows: token 0 at position 0, in no slot, so never attended nor cached.
        filler = self.tokens_padding.pad(start) - start
        ids.extend([0] * filler)
        positions.extend([0] * filler)
        n_kept = len(kept)
        kept.extend([kept[-1] if kept else 0] * (self.kept_padding.pad(max(n_kept, 1)) - n_kept))
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),  # [1, T]
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),  # [1, T]
            use_cache=False,
            logits_to_keep=torch.tensor(kept, dtype=torch.long, device=self.device),  # [K]
            specdec_rows=slots,
        )
        logits = out.logits[0]  # [K, vocab]
        result, at = [], 0
        for row in rows:
            row.kv.length += len(row.tokens)
            result.append(logits[at:at + row.keep])  # [keep, vocab]
            at += row.keep
        return result


def unsupported(model: torch.nn.Module) -> str:
    """Why the row-wise forward cannot serve this model ("" if it can).

    Structural checks first (sliding windows are not handled: a window needs
    its own K/V slice per layer), then a numeric one: a few sessions through
    the row-wise forward against the stock forward with a DynamicCache.
    """
    from transformers import DynamicCache

    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={config.sliding_window})"
    if any(getattr(m, "sliding_window", None) for m in model.modules()):
        return "sliding-window attention layers"
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if len(attention) != getattr(config, "num_hidden_layers", -1):
        return "no layer_idx/q_proj attention module per layer"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit soft-capping"
    original = config._attn_implementation
    stock = "sdpa" if original == ATTENTION else original  # the reference: the model's own attention
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator(device="cpu").manual_seed(1)
    device = next(model.parameters()).device
    steps = [[6, 1], [1, 3]]  # tokens fed per step, per session: prefill, decode, multi-token
    streams = [torch.randint(0, vocab, (sum(s[i] for s in steps),), generator=gen).tolist() for i in range(2)]
    try:
        with torch.inference_mode():
            config._attn_implementation = ATTENTION
            forward = RowsForward(model, RowPadding([4], None), RowPadding([4], None))
            kvs = [forward.new_cache() for _ in streams]
            fed = [0] * len(streams)
            rows_out = [[] for _ in streams]
            for step in steps:
                rows = [Row(kv, streams[i][fed[i]:fed[i] + n], n) for i, (kv, n) in enumerate(zip(kvs, step))]
                for i, logits in enumerate(forward(rows)):
                    rows_out[i].append(logits.float())
                    fed[i] += step[i]
            config._attn_implementation = stock
            for i, stream in enumerate(streams):
                cache, at, reference = DynamicCache(config=config), 0, []
                for step in steps:
                    n = step[i]
                    out = model(input_ids=torch.tensor([stream[at:at + n]], device=device),
                                position_ids=torch.arange(at, at + n, device=device)[None],
                                cache=cache, use_cache=True, logits_to_keep=n)
                    reference.append(out.logits[0].float())
                    at += n
                a, b = torch.cat(rows_out[i]), torch.cat(reference)  # [tokens, vocab]
                # Loose on purpose: other kernels round differently (SmolLM2 fp32 on
                # random tokens: 3e-3 of logits up to ~25), while a wrong position,
                # mask or cache slot moves logits by a good part of their range.
                scale = 1.0 + float(b.abs().max())
                tol = (1e-2 if next(model.parameters()).dtype == torch.float32 else 5e-2) * scale
                diff = float((a - b).abs().max())
                if diff > tol:
                    return f"self-check: row-wise logits differ from the stock forward by {diff:.3g} (> {tol:.3g})"
    except Exception as exc:  # any model this code does not know how to drive
        return f"self-check failed: {type(exc).__name__}: {exc}"
    finally:
        config._attn_implementation = original
    return ""


def enable(model: torch.nn.Module) -> None:
    """Route the model's attention through the row-wise function (for good)."""
    model.config._attn_implementation = ATTENTION

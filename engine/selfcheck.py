"""Start-up checks of the engine's own forward against the model's, and of batch invariance.

  * numerics: a few sessions (a prefill, then a 3-token step) through the
    pooled forward against the model's own forward with its own cache. Other
    kernels round differently (SmolLM2 fp32: ~3e-4 of logits up to ~25), while
    a wrong position, mask or cache slot moves logits by a good part of their
    range, so the tolerance is loose on purpose and the argmax must agree.
  * verify shapes: every position's logits, bitwise, whether its token is fed
    one at a time alone (target-only decoding), in a Score of 1 .. max_k + 1
    tokens alone or packed with other sessions, as a token-tree node, or after
    a prefill cut in other chunks. This is what greedy identity and the seeded
    coupling rest on, in the served dtype on the serving device.

`numerics` failing means the engine must not serve this model (the host falls
back to the stock forward); what `verify_shapes` failing means is the host's
(engine.host: a target refuses to start).
"""
from __future__ import annotations

import torch

from engine.model import eagle3
from engine.model.drafts import head_hidden
from engine.plan import RowPlan, StepPlan
from engine.runner import PooledRunner
from engine.stock import cache_kwarg


POOL_TOKENS = 2048  # the checks' own pool: 4 sessions of at most 74 tokens, in 16-token blocks


def _streams(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lengths = (9, 30, 3, 70)  # short, medium, tiny, longer than a 64-key bucket
    return [torch.randint(0, vocab, (n + 4,), generator=gen).tolist() for n in lengths]


def _run(runner: PooledRunner, caches: list, parts: list[list[int]],
         features: list[torch.Tensor] | None = None, trees: list | None = None) -> list[torch.Tensor]:
    """One forward over the given rows; each row's logits for all its tokens (a tree row: its
    nodes'), as float32."""
    features = features or [None] * len(parts)
    trees = trees or [None] * len(parts)
    rows = [RowPlan(cache, tokens, cache.length, len(tokens), features=f, tree=tree)
            for cache, tokens, f, tree in zip(caches, parts, features, trees)]
    for row in rows:
        row.cache.reserve(row.past + len(row.tokens))
    logits = runner.logits(StepPlan(rows))
    out, at = [], 0
    for row in rows:
        out.append(logits[at:at + row.emit].float())
        at += row.emit
    return out


def numerics(runner: PooledRunner, model: torch.nn.Module, vocab: int) -> str:
    """"" if the pooled forward matches the model's own; else what differs."""
    from transformers import DynamicCache

    kwarg = cache_kwarg(model)
    device = runner.device
    streams = _streams(vocab, 1)
    # A feature head: random features; the reference is drafts.head_hidden (EAGLE-3: eagle3.reference_logits).
    dim = runner.forward.feature_dim
    gen = torch.Generator(device="cpu").manual_seed(3)
    feats = [torch.randn(len(s), dim, generator=gen).to(device, runner.forward.dtype) if dim else None
             for s in streams]
    caches = [runner.new_cache() for _ in streams]
    try:
        first = _run(runner, caches, [s[:-3] for s in streams], [f[:-3] for f in feats] if dim else None)
        second = _run(runner, caches, [s[-3:] for s in streams], [f[-3:] for f in feats] if dim else None)
        ours = [torch.cat(pair) for pair in zip(first, second)]
    finally:
        for cache in caches:
            cache.free()
    for stream, feat, mine in zip(streams, feats, ours):
        if dim and eagle3.is_eagle3(model):
            ref = eagle3.reference_logits(model, torch.tensor(stream, device=device), feat).float()
        elif dim:
            hidden = head_hidden(model, torch.tensor([stream], device=device), feat[None],
                                 position_ids=torch.arange(len(stream), device=device)[None])
            ref = model.lm_head(hidden)[0].float()
        else:
            cache = DynamicCache(config=model.config)
            reference = []
            for lo, hi in ((0, len(stream) - 3), (len(stream) - 3, len(stream))):
                out = model(input_ids=torch.tensor([stream[lo:hi]], device=device),
                            position_ids=torch.arange(lo, hi, device=device)[None],
                            use_cache=True, **{kwarg: cache})
                reference.append(out.logits[0].float())
            ref = torch.cat(reference)
        finite = torch.isfinite(ref)
        if not torch.equal(finite, torch.isfinite(mine)):
            return "self-check: the engine's forward masks other logits than the model's"
        scale = 1.0 + float(ref[finite].abs().max())
        tol = (1e-2 if runner.forward.dtype == torch.float32 else 5e-2) * scale
        diff = float((mine[finite] - ref[finite]).abs().max())
        if diff > tol:
            return f"self-check: the engine's logits differ from the model's by {diff:.3g} (> {tol:.3g})"
    return ""


def _tree(stream: list[int], base: int, vocab: int):
    """A token tree above `base` whose first-children path is the stream's next 3 tokens, each with a
    sibling: (tokens, TreeRow, node indices of the path)."""
    from engine.tree import PendingTree

    parents = [-1, -1, 0, 0, 2, 2]
    off = [stream[base], (stream[base] + 1) % vocab, stream[base + 1], (stream[base + 1] + 7) % vocab,
           stream[base + 2], (stream[base + 2] + 3) % vocab]
    return off, PendingTree(base, 0).row(0, parents), [0, 2, 4]


def verify_shapes(runner, vocab: int, max_k: int, *, packed: bool = True, trees: bool = True) -> str:
    """"" if every position's logits are bitwise the same however its forward is shaped; else which differ.

    The reference: each stream prefilled, then fed one token at a time, alone (what target-only
    decoding computes). Against it, per position: a Score of 1 .. max_k + 1 tokens alone and packed
    with the other streams, a token tree whose path is the stream (a sibling beside each node), and
    the prefill cut in other chunks. Greedy identity and the seeded coupling rest on this.
    """
    steps = max_k + 1
    gen = torch.Generator(device="cpu").manual_seed(2)
    prefill = [9, 30, 3, 70]  # short, medium, tiny, longer than 64 keys; then steps tokens to score
    streams = [torch.randint(0, vocab, (n + steps,), generator=gen).tolist() for n in prefill]
    bad: list[str] = []

    def session(stream: list[int], cut: int, chunks: int = 1):
        cache = runner.new_cache()
        size = -(-cut // chunks)
        for lo in range(0, cut, size):
            _run(runner, [cache], [stream[lo:min(cut, lo + size)]])
        return cache

    reference = []
    for stream, cut in zip(streams, prefill):
        cache = session(stream, cut)
        reference.append(torch.cat([_run(runner, [cache], [[t]])[0] for t in stream[cut:]]))
        cache.free()
    caches = [session(stream, cut) for stream, cut in zip(streams, prefill)]
    try:
        for n in range(1, steps + 1):  # every Score size packed; a few alone
            alone = n in (1, 2, steps) or not packed
            groups = ([[i] for i in range(len(streams))] if alone else []) + (
                [list(range(len(streams)))] if packed else [])
            for group in groups:
                got = _run(runner, [caches[i] for i in group],
                             [streams[i][prefill[i]:prefill[i] + n] for i in group])
                for i, logits in zip(group, got):
                    caches[i].crop(prefill[i])
                    if not torch.equal(logits, reference[i][:n]):
                        bad.append(f"session {i}: {n} token(s) {'packed' if len(group) > 1 else 'alone'}")
        if trees and steps >= 3:
            parts, rows, paths = [], [], []
            for stream, cut in zip(streams, prefill):
                tokens, row, path = _tree(stream, cut, vocab)
                parts.append(tokens)
                rows.append(row)
                paths.append(path)
            got = _run(runner, caches, parts, trees=rows)
            for i, (logits, path) in enumerate(zip(got, paths)):
                caches[i].crop(prefill[i])
                if not torch.equal(logits[path], reference[i][:3]):
                    bad.append(f"session {i}: a token tree's path")
    finally:
        for cache in caches:
            cache.free()
    for i, (stream, cut) in enumerate(zip(streams, prefill)):  # the prefix in other chunks
        cache = session(stream, cut, chunks=3)
        got = _run(runner, [cache], [stream[cut:cut + 1]])[0]
        cache.free()
        if not torch.equal(got, reference[i][:1]):
            bad.append(f"session {i}: after a prefill in 3 chunks")
    return "" if not bad else "not bitwise invariant: " + ", ".join(bad[:6]) + (
        f" (and {len(bad) - 6} more)" if len(bad) > 6 else "")

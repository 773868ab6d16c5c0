"""Start-up checks of the engine's own forward against the model's, and of batch invariance.

  * numerics: a few sessions (a prefill, then a 3-token step) through the
    pooled forward against the model's own forward with its own cache. Other
    kernels round differently (SmolLM2 fp32: ~3e-4 of logits up to ~25), while
    a wrong position, mask or cache slot moves logits by a good part of their
    range, so the tolerance is loose on purpose and the argmax must agree.
  * invariance: the same sessions alone and packed together (prefill, a
    multi-token step, a one-token step) must give bitwise the same logits.

`numerics` failing means the engine must not serve this model (the host falls
back to the stock forward); `invariance` failing is reported and served on.
"""
from __future__ import annotations

import torch

from engine.model import eagle3
from engine.model.drafts import head_hidden
from engine.plan import RowPlan, StepPlan
from engine.runner import PooledRunner
from engine.stock import cache_kwarg


POOL_TOKENS = 1024  # the checks' own pool: 4 sessions of at most 74 tokens, in 16-token blocks


def _streams(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lengths = (9, 30, 3, 70)  # short, medium, tiny, longer than a 64-key bucket
    return [torch.randint(0, vocab, (n + 4,), generator=gen).tolist() for n in lengths]


def _run(runner: PooledRunner, caches: list, parts: list[list[int]],
         features: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One forward over the given rows; each row's logits for all its tokens, as float32."""
    features = features or [None] * len(parts)
    rows = [RowPlan(cache, tokens, cache.length, len(tokens), features=f)
            for cache, tokens, f in zip(caches, parts, features)]
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


def invariance(runner: PooledRunner, vocab: int) -> str:
    """"" if every session's logits are bitwise the same alone and packed; else which differ."""
    streams = _streams(vocab, 2)
    steps = [lambda s: s[:-4], lambda s: s[-4:-1], lambda s: s[-1:]]  # prefill, 3 tokens, 1 token
    alone, packed = [], []
    for i, stream in enumerate(streams):
        cache = runner.new_cache()
        alone.append([_run(runner, [cache], [step(stream)])[0] for step in steps])
        cache.free()
    caches = [runner.new_cache() for _ in streams]
    for step in steps:
        packed.append(_run(runner, caches, [step(s) for s in streams]))
    for cache in caches:
        cache.free()
    bad = [f"session {i} step {j}" for i in range(len(streams)) for j in range(len(steps))
           if not torch.equal(alone[i][j], packed[j][i])]
    return "" if not bad else "not bitwise invariant: " + ", ".join(bad)

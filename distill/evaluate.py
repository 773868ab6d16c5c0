"""How good and how cheap a draft is, on held-out target responses.

- Greedy agreement: teacher-forced, the fraction of response positions where
  the draft's argmax is the target's greedy token.
- Tokens per target pass at k = 1..8, simulated exactly from the per-position
  agreement pattern: in greedy speculative decoding a round accepts the run of
  agreeing positions (at most k) and adds one target token, and as long as the
  draft agrees its own tokens are the target's, so teacher forcing sees what
  the loop would see.
- Cost: c = draft one-token forward / target one-token forward, and v(k) =
  target forward over k + 1 tokens / one token, timed interleaved with a KV
  cache, same threads; then the speed-up E/(v + k c) and the break-even alpha.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from specdec.core.speedup import break_even_alpha, expected_tokens_per_pass
from engine.model.drafts import subset_of
from distill.train import head_logits


@torch.inference_mode()
def agreement_patterns(model: Any, records: Sequence[dict[str, Any]], *, batch_size: int = 8) -> list[list[bool]]:
    """For each record: does the draft's argmax equal the response token, per position."""
    device = next(model.parameters()).device
    subset = subset_of(model)
    patterns: list[list[bool]] = []
    for b in range(0, len(records), batch_size):
        chunk = records[b:b + batch_size]
        seqs = [r["prompt"] + r["response"][:-1] for r in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)  # [b, width], right padded
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, device=device)
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [b, width, hidden]
        for i, r in enumerate(chunk):
            start = len(r["prompt"]) - 1
            logits = head_logits(model, hidden[i, start:start + len(r["response"])])  # [n, head rows]
            guess = logits.float().argmax(-1)
            if subset is not None:
                guess = subset[guess]  # head column -> token id
            patterns.append((guess.cpu() == torch.tensor(r["response"])).tolist())
    return patterns


def simulate_tokens_per_pass(patterns: Sequence[Sequence[bool]], k: int) -> float:
    """Committed tokens per target pass for greedy speculative decoding with k drafts."""
    tokens = passes = 0
    for agree in patterns:
        pos, n = 0, len(agree)
        while pos < n:
            run = 0
            while run < k and pos + run < n and agree[pos + run]:
                run += 1
            step = min(run + 1, n - pos)  # accepted drafts + the target's own token
            pos += step
            tokens += step
            passes += 1
    return tokens / passes if passes else 0.0


def coverage(records: Sequence[dict[str, Any]], subset: torch.Tensor | None) -> float:
    """Fraction of response tokens the draft's head can emit at all."""
    if subset is None:
        return 1.0
    allowed = set(subset.tolist())
    total = sum(len(r["response"]) for r in records)
    return sum(t in allowed for r in records for t in r["response"]) / max(total, 1)


def quality(model: Any, records: Sequence[dict[str, Any]], ks: Sequence[int] = range(1, 9)) -> dict[str, Any]:
    patterns = agreement_patterns(model, records)
    agree = sum(sum(p) for p in patterns)
    total = sum(len(p) for p in patterns)
    alpha = agree / max(total, 1)
    return {
        "positions": total,
        "agreement": round(alpha, 4),
        "tokens_per_pass": {k: round(simulate_tokens_per_pass(patterns, k), 3) for k in ks},
        "tokens_per_pass_iid": {k: round(expected_tokens_per_pass(alpha, k), 3) for k in ks},
    }


@torch.inference_mode()
def _step_ms(model: Any, context: list[int], n_tokens: int, repeats: int) -> list[float]:
    """Times of forwards over n_tokens new tokens after `context` (cache cropped back each time)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([context], device=device)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    new = torch.tensor([context[-n_tokens:]], device=device)
    pos = torch.arange(len(context), len(context) + n_tokens, device=device).unsqueeze(0)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        logits = model(input_ids=new, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=n_tokens)
        logits.logits.float().argmax(-1).tolist()  # what a service does with them (and a sync)
        times.append((time.perf_counter() - started) * 1e3)
        cache.crop(-n_tokens)  # transformers: a negative count drops from the end
    return times


def cost(draft: Any, target: Any, context: list[int], *, repeats: int = 30, ks: Sequence[int] = range(1, 9)) -> dict[str, Any]:
    """Median one-token forward of draft and target, and v(k); timed interleaved.

    Interleaving (draft/target, and 1-token/(k+1)-token target forwards) makes a
    change of load from other processes hit both sides of each ratio alike.
    """
    draft_ms, target_ms = [], []
    for _ in range(3):
        draft_ms += _step_ms(draft, context, 1, repeats)
        target_ms += _step_ms(target, context, 1, repeats)
    d1, t1 = statistics.median(draft_ms), statistics.median(target_ms)
    verify = {}
    for k in ks:
        one, many = [], []
        for _ in range(4):
            one += _step_ms(target, context, 1, 3)
            many += _step_ms(target, context, k + 1, 3)
        verify[k] = round(statistics.median(many) / statistics.median(one), 3)
    return {"draft_ms": round(d1, 3), "target_ms": round(t1, 3), "c": round(d1 / t1, 4), "v": verify,
            "context": len(context)}


def speedups(tokens_per_pass: dict[int, float], c: float, v: dict[int, float], alpha: float) -> dict[str, Any]:
    """Expected speed-up per k from the simulated tokens/pass, the best k, and break-even alpha."""
    per_k = {k: round(tokens_per_pass[k] / (v[k] + k * c), 3) for k in tokens_per_pass}
    best = max(per_k, key=lambda k: (per_k[k], -k))
    return {
        "speedup": per_k,
        "best_k": best,
        "break_even_alpha": {k: (None if (a := break_even_alpha(k, c, v[k])) is None else round(a, 3)) for k in v},
        "alpha": alpha,
    }

"""Self-distillation data: the target's greedy responses and its top-k log-probs.

Prompts are generated in batches with left padding; at every step the target's
log-softmax is reduced to its top-k (ids + fp16 log-probs) and stored next to
the greedy token, so the soft labels cost nothing beyond generation. Rows that
finish (EOS) leave the batch, so long responses do not keep short ones paying.

Output: DIR/shard-NNNNN.pt, each a list of records
  {"id": prompt id, "prompt": [ids], "response": [ids],
   "topk_ids": int32 [len(response), k], "topk_logprobs": float16 [len(response), k]}
Shards are written atomically; a rerun skips the shards that exist (resumable).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distill.prompts import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenConfig:
    max_new_tokens: int = 256
    batch_size: int = 32
    top_k: int = 20
    shard_prompts: int = 128  # prompts per shard (one resumable unit)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompts: Sequence[list[int]],
    eos_ids: Iterable[int],
    *,
    max_new_tokens: int,
    top_k: int,
    pad_id: int,
) -> list[dict[str, Any]]:
    """Greedy-generate every prompt (left padded); responses with their top-k log-probs."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    eos = torch.tensor(sorted(set(eos_ids)), device=device)
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)  # [n, width]
    mask = torch.zeros((n, width), dtype=torch.long, device=device)  # [n, width]
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, width]
    cache = DynamicCache(config=model.config)
    rows = torch.arange(n, device=device)  # which prompt each live batch row is
    tokens: list[list[torch.Tensor]] = [[] for _ in range(n)]
    top_ids: list[list[torch.Tensor]] = [[] for _ in range(n)]
    top_lp: list[list[torch.Tensor]] = [[] for _ in range(n)]
    step_ids = ids
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                    cache=cache, use_cache=True, logits_to_keep=1)
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [live, vocab]
        lp, ti = logp.topk(top_k, dim=-1)  # [live, k]; ti[:, 0] is the greedy token
        token = ti[:, 0]
        for j, r in enumerate(rows.tolist()):
            tokens[r].append(token[j])
            top_ids[r].append(ti[j])
            top_lp[r].append(lp[j])
        keep = ~torch.isin(token, eos)  # [live]
        if not bool(keep.any()):
            break
        if not bool(keep.all()):  # drop finished rows from the batch and the cache
            index = keep.nonzero().squeeze(-1)
            rows, token, mask, positions = rows[index], token[index], mask[index], positions[index]
            cache.batch_select_indices(index)
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
        positions = positions[:, -1:] + 1
        step_ids = token.unsqueeze(-1)
    records = []
    for i in range(n):
        records.append({
            "prompt": list(prompts[i]),
            "response": torch.stack(tokens[i]).tolist(),
            "topk_ids": torch.stack(top_ids[i]).to("cpu", torch.int32),  # [len, k]
            "topk_logprobs": torch.stack(top_lp[i]).to("cpu", torch.float16),  # [len, k]
        })
    return records


def shard_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:05d}.pt"


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    out_dir: Path,
    eos_ids: Iterable[int],
    config: GenConfig,
    *,
    desc: str = "generating",
    deadline: float | None = None,
) -> list[Path]:
    """Generate (or resume) the shards for `prompts` under `out_dir`; return the written ones.

    With `deadline` (time.monotonic()), no new shard is started after it: a time
    budget for the data stage; a later run resumes where this one stopped.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_ids = list(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    starts = range(0, len(prompts), config.shard_prompts)
    paths = [shard_path(out_dir, i) for i in range(len(starts))]
    todo = [(i, s) for i, s in enumerate(starts) if not paths[i].is_file()]
    done_prompts = sum(min(config.shard_prompts, len(prompts) - s) for i, s in enumerate(starts) if paths[i].is_file())
    if done_prompts:
        log.info("%s: %d of %d prompts already done (resuming)", out_dir, done_prompts, len(prompts))
    started, new_tokens = time.monotonic(), 0
    with tqdm(total=len(prompts), initial=done_prompts, desc=desc, unit="prompt") as bar:
        for index, start in todo:
            if deadline is not None and time.monotonic() > deadline and any(p.is_file() for p in paths):
                log.warning("%s: time budget spent after %d of %d shards; rerun to continue",
                            out_dir, sum(p.is_file() for p in paths), len(paths))
                break
            chunk = list(prompts[start:start + config.shard_prompts])
            encoded = [encode_prompt(tokenizer, p) for p in chunk]
            # Similar prompt lengths in one batch waste less padding.
            order = sorted(range(len(chunk)), key=lambda i: len(encoded[i]))
            records: list[dict[str, Any] | None] = [None] * len(chunk)
            for b in range(0, len(order), config.batch_size):
                batch = order[b:b + config.batch_size]
                out = generate_batch(
                    model, [encoded[i] for i in batch], eos_ids,
                    max_new_tokens=config.max_new_tokens, top_k=config.top_k, pad_id=pad_id,
                )
                for i, record in zip(batch, out):
                    record["id"] = chunk[i].id
                    records[i] = record
                    new_tokens += len(record["response"])
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.monotonic() - started, 1e-9):.0f}")
            tmp = paths[index].with_suffix(".tmp")
            torch.save(records, tmp)
            os.replace(tmp, paths[index])
    return [p for p in paths if p.is_file()]


def load_records(out_dir: Path) -> list[dict[str, Any]]:
    """Every record of every shard under `out_dir`, in shard order."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(out_dir).glob("shard-*.pt")):
        records.extend(torch.load(path, weights_only=True))
    return records

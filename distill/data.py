"""Self-distillation data: the target's greedy responses and its top-k log-probs.

At every step the target's log-softmax is reduced to its top-k (ids + fp16
log-probs) and stored next to the greedy token, so the soft labels cost nothing
beyond generation. Where the serving engine's forward runs the target
(engine.model.llama), a shard goes through it continuously batched (generate_pooled):
a finished row's place goes to the next prompt at once and the paged KV pool
copies nothing per step. Otherwise (generate_batch) prompts go through
transformers in left-padded batches whose finished rows leave the batch. On the
embedded target, 2 CPU threads, 192-token responses: 162 tokens/s pooled
(128 rows) against 56 for the padded batches of 128, whose DynamicCache copied
its whole KV every step (75% of a step's time).

Output: DIR/shard-NNNNN.pt, each a list of records
  {"id": prompt id, "prompt": [ids], "response": [ids],
   "topk_ids": int32 [len(response), k], "topk_logprobs": float16 [len(response), k]}
With `GenConfig.features` a record also holds "features": float16
[len(prompt) + len(response) - 1, n x H], at every position the target read (the
prompt's from the prefill, each response token's from the step that fed it) the
hidden states the tuple names, side by side: -1 (engine.plan.LAST) its final
state after the final norm (what its LM head reads, an EAGLE-1 head's input), a
decoder layer id the residual stream entering that layer (an EAGLE-3 head's
inputs). A feature head trains on them without a second, teacher-forced pass.
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
    # hidden states to keep at every position read (see the module doc): () none, (-1,) the final state
    # (distill.eagle's data), decoder layer ids the streams entering them (distill.eagle3's)
    features: tuple[int, ...] = ()
    pooled: bool = True  # the serving engine's forward, continuously batched (generate_pooled), where it runs
    # Every n-th prompt (n = round(1 / sampled)) gets a sampled response instead of the greedy one: more
    # varied contexts; the labels stay the target's distribution (top-k, and topk_ids[:, 0] its argmax)
    sampled: float = 0.0
    sample_temperature: float = 1.0


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
    features: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Greedy-generate every prompt (left padded); responses with their top-k log-probs (and, with
    `features`, those hidden states of every position it read; see the module doc)."""
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
    feats: list[list[torch.Tensor]] = [[] for _ in range(n)]
    step_ids = ids
    for step in range(max_new_tokens):
        if features:  # the body's normed output is what the head reads; the logits of its last position
            body = model.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                               cache=cache, use_cache=True, output_hidden_states=True)
            hidden = body.last_hidden_state  # [live, t, H]
            logits = model.get_output_embeddings()(hidden[:, -1])  # [live, vocab]
            kept = torch.cat([hidden if i == -1 else body.hidden_states[i] for i in features],
                             dim=-1).to("cpu", torch.float16)  # [live, t, n x H]
            for j, r in enumerate(rows.tolist()):
                feats[r].append(kept[j, width - len(prompts[r]):] if step == 0 else kept[j])
        else:
            logits = model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                           cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        logp = torch.log_softmax(logits.float(), dim=-1)  # [live, vocab]
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
        if features:  # positions of prompt + response[:-1]: the last token was never fed
            records[-1]["features"] = torch.cat(feats[i])  # [len(prompt) + len(response) - 1, H]
    return records


def pooled_forward(model: Any) -> Any:
    """The engine's pooled runner over `model` (engine.runner), or None where its forward does not serve it."""
    from engine.model.llama import LlamaForward, unsupported

    return None if unsupported(model) else LlamaForward(model)


@torch.inference_mode()
def generate_pooled(
    forward: Any,
    prompts: Sequence[list[int]],
    eos_ids: Iterable[int],
    *,
    max_new_tokens: int,
    top_k: int,
    rows: int,
    features: tuple[int, ...] = (),
    prefill_tokens: int = 2048,
    sampled: Sequence[bool] = (),
    temperature: float = 1.0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """What generate_batch returns, from the serving engine's forward with continuous batching.

    Up to `rows` prompts are in flight; one that ends (EOS or the length cap) frees its KV at once
    and the next prompt's prefill joins the following forward (at most `prefill_tokens` prompt
    tokens per forward), so the batch stays full to the end instead of draining as rows finish, and
    the paged KV pool copies nothing per step. Greedy tokens are the argmax of the same logits; a
    prompt marked in `sampled` draws each token from the top-k at `temperature` instead (renormalised
    over the top-k; seeded by `seed` and the prompt's index, so a rerun writes the same shard).
    """
    from engine.plan import OutputSpec, RowPlan, StepPlan
    from engine.runner import PooledRunner

    eos = set(eos_ids)
    longest = max(len(p) for p in prompts) + max_new_tokens
    probe = forward.new_pool(0)  # its two blocks tell the bytes per position
    pool = forward.new_pool(probe.block_bytes * rows * (-(-longest // probe.block_size) + 1))
    runner = PooledRunner(forward, pool, fixed_shapes=False, max_rows=rows)
    spec = OutputSpec(logprobs=top_k)
    records: list[dict[str, Any] | None] = [None] * len(prompts)
    live: dict[int, dict[str, Any]] = {}  # prompt index -> its state
    waiting = list(range(len(prompts)))
    waiting.reverse()  # pop() takes them in order
    while live or waiting:
        budget = prefill_tokens
        while waiting and len(live) < rows and (budget == prefill_tokens or len(prompts[waiting[-1]]) <= budget):
            i = waiting.pop()
            budget -= len(prompts[i])
            live[i] = {"cache": runner.new_cache(), "feed": list(prompts[i]), "past": 0, "response": [],
                       "top_ids": [], "top_lp": [], "features": [],
                       "rng": torch.Generator().manual_seed(seed * 1_000_003 + i) if i < len(sampled) and sampled[i]
                       else None}
        plan_rows, order = [], []
        for i, state in live.items():
            state["cache"].reserve(state["past"] + len(state["feed"]))
            plan_rows.append(RowPlan(state["cache"], state["feed"], state["past"], 1, spec, hidden=tuple(features)))
            order.append(i)
        for i, out in zip(order, runner.run(StepPlan(plan_rows))):
            state = live[i]
            state["past"] += len(state["feed"])
            if features:
                state["features"].append(out.hidden.to(torch.float16))
            token = out.argmax[0]
            if state["rng"] is not None:  # a sampled response
                weights = torch.softmax(torch.tensor(out.logprobs.top_logprobs[0]) / temperature, dim=-1)
                token = int(out.logprobs.top_ids[0][int(torch.multinomial(weights, 1, generator=state["rng"]))])
            state["response"].append(token)
            state["top_ids"].append(out.logprobs.top_ids[0])
            state["top_lp"].append(out.logprobs.top_logprobs[0])
            if token in eos or len(state["response"]) >= max_new_tokens:
                state["cache"].free()
                del live[i]
                records[i] = {
                    "prompt": list(prompts[i]),
                    "response": state["response"],
                    "topk_ids": torch.tensor(state["top_ids"], dtype=torch.int32),  # [len, k]
                    "topk_logprobs": torch.tensor(state["top_lp"], dtype=torch.float16),  # [len, k]
                }
                if features:  # prompt + response[:-1]: the last token was never fed
                    records[i]["features"] = torch.cat(state["features"])
                if i < len(sampled) and sampled[i]:
                    records[i]["sampled"] = temperature
            else:
                state["feed"] = [token]
    return records  # type: ignore[return-value]


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
    forward = pooled_forward(model) if config.pooled else None
    if config.sampled and forward is None:
        raise ValueError("sampled responses need the engine's pooled forward (a Llama-architecture target)")
    every = round(1 / config.sampled) if config.sampled > 0 else 0
    with tqdm(total=len(prompts), initial=done_prompts, desc=desc, unit="prompt") as bar:
        for index, start in todo:
            if deadline is not None and time.monotonic() > deadline and any(p.is_file() for p in paths):
                log.warning("%s: time budget spent after %d of %d shards; rerun to continue",
                            out_dir, sum(p.is_file() for p in paths), len(paths))
                break
            chunk = list(prompts[start:start + config.shard_prompts])
            encoded = [encode_prompt(tokenizer, p) for p in chunk]
            if forward is not None:  # the whole shard through one continuously refilled batch
                out = generate_pooled(forward, encoded, eos_ids, max_new_tokens=config.max_new_tokens,
                                      top_k=config.top_k, rows=config.batch_size, features=config.features,
                                      sampled=[bool(every) and (start + j) % every == every - 1
                                               for j in range(len(chunk))],
                                      temperature=config.sample_temperature, seed=start)
                for prompt, record in zip(chunk, out):
                    record["id"] = prompt.id
                    new_tokens += len(record["response"])
                _write_shard(paths[index], out)
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.monotonic() - started, 1e-9):.0f}")
                continue
            # Similar prompt lengths in one batch waste less padding.
            order = sorted(range(len(chunk)), key=lambda i: len(encoded[i]))
            records: list[dict[str, Any] | None] = [None] * len(chunk)
            for b in range(0, len(order), config.batch_size):
                batch = order[b:b + config.batch_size]
                out = generate_batch(
                    model, [encoded[i] for i in batch], eos_ids,
                    max_new_tokens=config.max_new_tokens, top_k=config.top_k, pad_id=pad_id,
                    features=config.features,
                )
                for i, record in zip(batch, out):
                    record["id"] = chunk[i].id
                    records[i] = record
                    new_tokens += len(record["response"])
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.monotonic() - started, 1e-9):.0f}")
            _write_shard(paths[index], records)
    return [p for p in paths if p.is_file()]


def _write_shard(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(records, tmp)
    os.replace(tmp, path)


def load_records(out_dir: Path) -> list[dict[str, Any]]:
    """Every record of every shard under `out_dir`, in shard order."""
    records: list[dict[str, Any]] = []
    for path in sorted(Path(out_dir).glob("shard-*.pt")):
        records.extend(torch.load(path, weights_only=True))
    return records

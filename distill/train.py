"""Train the draft on the target's top-k distributions (soft cross-entropy).

Each record is one sequence, prompt + response; the draft reads the tokens
before each response position and is trained towards the target's top-k
distribution there (renormalised over the tokens its head can emit). Only the
decoder layers and the final norm learn; AdamW, linear warm-up then cosine.
A checkpoint (trainable tensors, optimiser, step) is written every
`ckpt_every` steps and at the end; a rerun resumes from it.
"""
from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.model.drafts import SubsetHead, trainable_named, trainable_parameters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_tokens: int = 4096  # response positions per optimiser step (about)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of steps
    min_lr: float = 0.1  # cosine floor, as a fraction of lr
    amp: str = "bfloat16"  # "bfloat16" autocast, or "float32" for none
    ckpt_every: int = 100
    label_temperature: float = 1.0  # < 1 sharpens the target's top-k towards its argmax
    seed: int = 0


def choose_subset(records: Sequence[dict[str, Any]], size: int, vocab: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent response tokens (then top-k alternatives), sorted by id.

    `always` (e.g. EOS ids) are included whatever their count; ties go to the lower id.
    """
    return torch.sort(vocab_order(records, vocab, always)[:size]).values


def vocab_order(records: Sequence[dict[str, Any]], vocab: int, always: Sequence[int] = (), *,
                response_weight: int = 1, prompt_weight: int = 0) -> torch.Tensor:
    """Every token id, most wanted first: by response_weight x its count in the responses + prompt_weight x
    its count in the prompts, then by its count among the target's top-k alternatives, then by id;
    `always` first."""
    responses = torch.tensor([t for r in records for t in r["response"]], dtype=torch.long)
    alternatives = torch.cat([r["topk_ids"][:, 1:].flatten() for r in records]).long()
    counts = response_weight * torch.bincount(responses, minlength=vocab).double()  # [vocab]
    if prompt_weight:
        prompts = torch.tensor([t for r in records for t in r["prompt"]], dtype=torch.long)
        counts = counts + prompt_weight * torch.bincount(prompts, minlength=vocab).double()
    alt = torch.bincount(alternatives, minlength=vocab).double()  # [vocab]
    # Rank by the weighted count, then alternative count (always < 1 count), then id.
    score = counts + alt / (alt.max() + 1)
    score[list(always)] = float("inf")
    return torch.sort(-score, stable=True).indices  # stable: equal scores keep id order


def make_batches(records: Sequence[dict[str, Any]], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group records of similar length so that each batch holds ~batch_tokens response positions."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt"]) + len(records[i]["response"]))
    batches, current, count = [], [], 0
    for i in order:
        current.append(i)
        count += len(records[i]["response"])
        if count >= batch_tokens:
            batches.append(current)
            current, count = [], 0
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(records: Sequence[dict[str, Any]], device: torch.device, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded inputs, and where (batch row, position) each response token is predicted."""
    seqs = [r["prompt"] + r["response"][:-1] for r in records]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [b, width]
    rows, cols = [], []
    for b, (r, s) in enumerate(zip(records, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        start = len(r["prompt"]) - 1  # the position whose next token is response[0]
        rows += [b] * len(r["response"])
        cols += range(start, start + len(r["response"]))
    return {
        "input_ids": ids.to(device),
        "rows": torch.tensor(rows, device=device),  # [n]
        "cols": torch.tensor(cols, device=device),  # [n]
        "labels": torch.tensor([t for r in records for t in r["response"]], device=device),  # [n]
        "topk_ids": torch.cat([r["topk_ids"] for r in records]).to(device, torch.long),  # [n, k]
        "topk_logprobs": torch.cat([r["topk_logprobs"] for r in records]).to(device, torch.float32),  # [n, k]
    }


def head_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """[n, hidden] -> [n, head rows]: subset logits for a SubsetHead, full otherwise."""
    head = model.get_output_embeddings()
    if isinstance(head, SubsetHead):
        return head.subset_logits(hidden)
    return head(hidden)


def column_map(model: Any, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] token id -> head column (-1 where the head cannot emit it)."""
    head = model.get_output_embeddings()
    if not isinstance(head, SubsetHead):
        return torch.arange(vocab, device=device)
    cmap = torch.full((vocab,), -1, dtype=torch.long, device=device)
    cmap[head.subset] = torch.arange(head.subset.numel(), device=device)
    return cmap


def soft_loss(
    logits: torch.Tensor, batch: dict[str, torch.Tensor], cmap: torch.Tensor, label_temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(soft cross-entropy to the target's top-k, greedy agreement) for one batch.

    logits: [n, head rows]. The target's top-k probabilities are renormalised
    over the tokens the head can emit; positions with none of them are skipped.
    """
    cols = cmap[batch["topk_ids"]]  # [n, k], -1 = outside the head
    present = cols >= 0
    logp_t = batch["topk_logprobs"].masked_fill(~present, float("-inf"))
    usable = present.any(-1)  # [n]
    p_t = torch.softmax(logp_t[usable] / label_temperature, dim=-1)  # [m, k]
    logq = torch.log_softmax(logits[usable].float(), dim=-1)  # [m, rows]
    picked = logq.gather(-1, cols[usable].clamp(min=0))  # [m, k]
    loss = -(p_t * picked).masked_fill(~present[usable], 0.0).sum(-1).mean()
    agree = (logits.argmax(-1) == cmap[batch["labels"]]).float().mean()
    return loss, agree


def autocast(device: torch.device, amp: str):
    if amp == "float32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def lr_at(step: int, config: TrainConfig) -> float:
    warm = max(1, int(config.warmup * config.steps))
    if step < warm:
        return config.lr * (step + 1) / warm
    t = (step - warm) / max(1, config.steps - warm)
    return config.lr * (config.min_lr + (1 - config.min_lr) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def resume(ckpt: Path, model: Any, optimizer: Any, config: Any) -> tuple[int, list, Any]:
    """(step, history, config) from `ckpt` if it exists (trainable tensors and optimiser restored), else fresh."""
    if not ckpt.is_file():
        return 0, [], config
    device = next(model.parameters()).device
    state = torch.load(ckpt, map_location=device, weights_only=False)
    if state["config"]["steps"] != config.steps:
        log.warning("checkpoint %s was for %d steps; continuing with %d", ckpt, state["config"]["steps"],
                    config.steps)
        config = replace(config, steps=max(config.steps, state["step"]))
    named = dict(trainable_named(model))
    with torch.no_grad():
        for name, value in state["model"].items():
            named[name].copy_(value)
    optimizer.load_state_dict(state["optimizer"])
    log.info("resuming from %s at step %d", ckpt, state["step"])
    return state["step"], state["history"], config


def save_checkpoint(ckpt: Path, model: Any, optimizer: Any, step: int, history: list, config: Any) -> None:
    """Trainable tensors, optimiser, step and history, written atomically."""
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"model": {n: p.detach().cpu() for n, p in trainable_named(model)},
                "optimizer": optimizer.state_dict(), "step": step, "history": history,
                "config": asdict(config)}, tmp)
    os.replace(tmp, ckpt)


def replay_batches(records: Sequence[dict[str, Any]], batch_tokens: int, rng: random.Random,
                   step: int) -> tuple[list[list[int]], int]:
    """(batches left, epoch) after `step` steps: the shuffles replayed, so a resumed run sees the same order."""
    batches: list[list[int]] = []
    epoch = 0
    for _ in range(step):
        if not batches:
            batches = make_batches(records, batch_tokens, rng)
            epoch += 1
        batches.pop()
    return batches, epoch


def optimizer_step(loss: torch.Tensor, optimizer: Any, params: list) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


def fit_to_budget(config: Any, step: int, first_step: int, started: float, budget_s: float | None,
                  bar: Any, probe: int) -> Any:
    """Fewer steps if the rest would not fit the time budget: timed after `probe` steps, re-timed every 50."""
    if budget_s is None or step < first_step + probe or (step > first_step + probe and step % 50):
        return config
    elapsed = time.monotonic() - started
    per_step = elapsed / (step - first_step)
    fits = step + int((budget_s - elapsed) / per_step)
    if fits < config.steps:
        log.warning("time budget %.0f s: %.2f s/step, training %d steps instead of %d",
                    budget_s, per_step, max(fits, step), config.steps)
        config = replace(config, steps=max(fits, step))
        bar.total = config.steps
    return config


def train(
    model: Any,
    records: Sequence[dict[str, Any]],
    config: TrainConfig,
    ckpt: Path,
    *,
    pad_id: int,
    vocab: int,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """Train `model` (a draft from build_from_target) in place; returns a summary.

    With `budget_s`, the step count is cut (after timing the first steps) so that
    training ends within about that many seconds; the cosine schedule follows.
    """
    from tqdm import tqdm

    device = next(model.parameters()).device
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    step, history, config = resume(ckpt, model, optimizer, config)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    cmap = column_map(model, vocab, device)
    rng = random.Random(config.seed)
    batches, epoch_of_step = replay_batches(records, config.batch_tokens, rng, step)
    model.train()
    started, first_step = time.monotonic(), step
    window: list[tuple[float, float, int]] = []
    with tqdm(total=config.steps, initial=step, desc="training", unit="step") as bar:
        while step < config.steps:
            if not batches:
                batches = make_batches(records, config.batch_tokens, rng)
                epoch_of_step += 1
            batch = collate([records[i] for i in batches.pop()], device, pad_id)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            with autocast(device, config.amp):
                hidden = model.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
                logits = head_logits(model, hidden[batch["rows"], batch["cols"]])  # [n, rows]
            loss, agree = soft_loss(logits, batch, cmap, config.label_temperature)
            optimizer_step(loss, optimizer, params)
            step += 1
            config = fit_to_budget(config, step, first_step, started, budget_s, bar, probe=20)
            window.append((loss.item(), agree.item(), len(batch["labels"])))
            if step % 10 == 0 or step == config.steps:
                n = sum(w[2] for w in window)
                mean_loss = sum(w[0] * w[2] for w in window) / n
                mean_agree = sum(w[1] * w[2] for w in window) / n
                history.append({"step": step, "epoch": epoch_of_step, "loss": round(mean_loss, 4),
                                "train_agreement": round(mean_agree, 4), "lr": lr_at(step - 1, config)})
                bar.set_postfix(loss=f"{mean_loss:.3f}", agree=f"{mean_agree:.3f}", epoch=epoch_of_step)
                window = []
            bar.update(1)
            if step % config.ckpt_every == 0 or step == config.steps:
                save_checkpoint(ckpt, model, optimizer, step, history, config)
    model.eval()
    return {"steps": step, "epochs": epoch_of_step, "seconds": round(time.monotonic() - started, 1),
            "history": history, "config": asdict(config)}

"""Train and evaluate an EAGLE-style feature head (engine.model.drafts, kind "eagle").

Data: the data stage's records (prompt + greedy response). For each record the
frozen target runs teacher-forced over prompt + response[:-1] and its features
F [n, H] (final hidden state after the final norm, what its LM head reads) are
kept in fp16, cached per data shard under OUT/eagle-features/ so a rerun
resumes. The target's distribution at position q is softmax(lm_head(F_q)), so
no stored top-k labels are needed.

Head input at position q: token x_q and the target's F_{q-1} (zeros at q = 0);
its output h_q predicts F_q and, through the frozen (subset) LM head, x_{q+1}.

Training-time test (`depth` > 1 unrolled passes): pass d feeds, at position q,
the head's own pass-(d-1) output at q - 1 as the feature, and attends exactly as
drafting at depth d would: to pass-1 keys (true features) up to q - d + 1 and
to the pass-i key at q - d + i for i = 2..d (`multi_pass`). Pass d at q is
therefore precisely the head's output when it drafts its d-th token from the
committed prefix ending at q - d + 1, given that drafts 1..d-1 were right.
Loss per pass: KL from the target's subset distribution to the head's
(response positions; the soft cross-entropy less the target's entropy), plus `feature_weight` x SmoothL1(h, F) (every
position), pass d weighted `depth_decay`^(d-1).

Evaluation uses the same identity: one batched forward of `k` passes gives,
for every start position, how many of the head's greedy drafts the target
accepts, so tokens per target pass are simulated exactly for k = 1..8; a
sequential chain on a DynamicCache (the way a service drafts) cross-checks it
on sampled starts.
"""
from __future__ import annotations

import logging
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from distill.train import (
    autocast, column_map, fit_to_budget, head_logits, lr_at, make_batches, optimizer_step, replay_batches, resume,
    save_checkpoint,
)
from engine.model.drafts import subset_of, target_features, trainable_parameters

log = logging.getLogger(__name__)

FEATURES = "eagle-features"


# ---------------------------------------------------------------------------------------------------- features

def _sequence(record: dict[str, Any]) -> list[int]:
    """The tokens the target reads teacher-forced: prompt + response[:-1] (its features predict the response)."""
    return list(record["prompt"]) + list(record["response"][:-1])


@torch.inference_mode()
def extract(target: Any, records: Sequence[dict[str, Any]], *, dtype: torch.dtype, batch_tokens: int = 4096,
            pad_id: int = 0, desc: str = "features", layers: tuple[int, ...] = (-1,)) -> list[torch.Tensor]:
    """The target's features for every record: fp16 [len(prompt) + len(response) - 1, n x H] each (`layers`
    as engine.model.drafts.target_features).

    Right-padded batches of similar length (the causal mask keeps padding out
    of the real positions), run in `dtype` under autocast-free weights of that dtype.
    """
    from tqdm import tqdm

    device = next(target.parameters()).device
    order = sorted(range(len(records)), key=lambda i: len(_sequence(records[i])))
    out: list[torch.Tensor | None] = [None] * len(records)
    with tqdm(total=sum(len(_sequence(r)) for r in records), desc=desc, unit="tok", mininterval=10) as bar:
        b = 0
        while b < len(order):
            width = len(_sequence(records[order[b]]))
            e = b + 1
            while e < len(order) and (e - b + 1) * len(_sequence(records[order[e]])) <= batch_tokens:
                e += 1
            chunk = order[b:e]
            seqs = [_sequence(records[i]) for i in chunk]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            for j, s in enumerate(seqs):
                ids[j, :len(s)] = torch.tensor(s)
            feats = target_features(target, ids.to(device), layers=layers)  # [b, width, n x H]
            for j, (i, s) in enumerate(zip(chunk, seqs)):
                out[i] = feats[j, :len(s)].to("cpu", torch.float16).clone()
            bar.update(sum(len(s) for s in seqs))
            b = e
    return out  # type: ignore[return-value]


def cached_features(target: Any, data_dir: Path, cache_dir: Path, *, dtype: str, pad_id: int,
                    batch_tokens: int = 4096, shards: int | None = None, layers: tuple[int, ...] = (-1,)
                    ) -> tuple[list[dict[str, Any]], list[torch.Tensor], dict[str, Any]]:
    """(records, features, summary) of every data shard under `data_dir` (or its first `shards`), features
    (of `layers`, as engine.model.drafts.target_features) cached per shard; a shard whose records carry
    features of that width from their generation uses those."""
    width = len(layers) * int(target.config.hidden_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    features: list[torch.Tensor] = []
    started, computed, generated, tokens = time.monotonic(), 0, 0, 0
    for shard in sorted(Path(data_dir).glob("shard-*.pt"))[:shards]:
        shard_records = torch.load(shard, weights_only=True)
        path = cache_dir / (f"{shard.stem}-{dtype}.pt" if layers == (-1,)
                            else f"{shard.stem}-{dtype}-layers-{'-'.join(map(str, layers))}.pt")
        lengths = [len(_sequence(r)) for r in shard_records]
        kept = [r.pop("features", None) for r in shard_records]  # captured by the data stage's generation
        cached = torch.load(path, weights_only=True) if path.is_file() else None
        if all(f is not None and tuple(f.shape) == (n, width) for f, n in zip(kept, lengths)):
            feats = kept
            generated += sum(lengths)
        elif cached is None or cached["lengths"] != lengths:
            feats = extract(target, shard_records, dtype=target.dtype, batch_tokens=batch_tokens, pad_id=pad_id,
                            desc=f"{data_dir.name}/{shard.stem} features ({dtype})", layers=layers)
            tmp = path.with_suffix(".tmp")
            torch.save({"lengths": lengths, "dtype": dtype, "features": feats}, tmp)
            os.replace(tmp, path)
            computed += sum(lengths)
        else:
            feats = cached["features"]
        records += shard_records
        features += feats
        tokens += sum(lengths)
    seconds = time.monotonic() - started
    summary = {"records": len(records), "tokens": tokens, "computed_tokens": computed, "dtype": dtype,
               "seconds_this_run": round(seconds, 1)}
    if generated:
        summary["from_generation_tokens"] = generated  # kept by the data stage, in its generation dtype
    if computed:
        summary["tokens_per_s"] = round(computed / seconds, 1)
    log.info("%s features: %s", data_dir.name, summary)
    return records, features, summary


def feature_fidelity(target_model: Any, records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor],
                     limit: int = 64) -> float:
    """Fraction of response positions where argmax lm_head(F) is the record's greedy token (a sanity check)."""
    head = target_model.get_output_embeddings()
    same = total = 0
    with torch.inference_mode():
        for r, f in list(zip(records, features))[:limit]:
            start = len(r["prompt"]) - 1
            logits = head(f[start:].to(head.weight.dtype))
            same += int((logits.argmax(-1).cpu() == torch.tensor(r["response"])).sum())
            total += len(r["response"])
    return same / max(total, 1)


# ---------------------------------------------------------------------------------------------------- the head

def _shift(features: torch.Tensor) -> torch.Tensor:
    """[B, T, H] -> the feature that comes with each token: row t - 1 (zeros at t = 0)."""
    return torch.cat([features.new_zeros(features[:, :1].shape), features[:, :-1]], dim=1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def multi_pass(model: Any, ids: torch.Tensor, features: torch.Tensor, depth: int, *,
               noise: float = 0.0) -> list[torch.Tensor]:
    """The head's outputs [B, T, H] for passes 1..depth (see the module doc): an EAGLE-1 head's normed
    outputs (its predicted features), an EAGLE-3 head's pre-norm ones (what it feeds itself; `readout`
    gives the logits of either).

    ids [B, T] right-padded; features [B, T, n x H]: what the target hands the head at each position (row
    t its own, not yet shifted). Pass 1 reads them shifted (row t - 1 with token t); pass d >= 2 reads
    pass d-1's outputs, shifted, and attends to pass-1 keys at <= t-d+1 and to pass-i keys at t-d+i
    (i = 2..d). `noise`: uniform noise on the true input features, times their RMS.
    """
    from engine.model.eagle3 import is_eagle3

    inner = model.model
    three = is_eagle3(model)
    fc = inner.eagle3_fc if three else inner.fc
    embeds = model.get_input_embeddings()(ids)  # [B, T, H]
    B, T, _ = embeds.shape
    positions = torch.arange(T, device=ids.device).unsqueeze(0)
    cos, sin = inner.rotary_emb(embeds, position_ids=positions)  # [1, T, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    t_idx = torch.arange(T, device=ids.device)
    layers = list(inner.layers)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layers]  # per layer, per pass
    outputs: list[torch.Tensor] = []
    feats = _shift(features.to(fc.weight.dtype))
    if noise > 0:
        rms = feats.float().pow(2).mean().sqrt()
        feats = feats + (torch.rand_like(feats) * 2 - 1) * (noise * rms).to(feats.dtype)
    for d in range(1, depth + 1):
        if three:  # g: fc(the target's layers) on pass 1, then the head's own pre-norm output
            x = fc(feats) if d == 1 else _shift(outputs[-1])
            first = torch.cat([layers[0].input_layernorm(embeds), layers[0].hidden_norm(x).to(embeds.dtype)], dim=-1)
        else:
            if d > 1:
                feats = _shift(outputs[-1])
            x = fc(torch.cat([embeds, feats.to(embeds.dtype)], dim=-1))
        for li, layer in enumerate(layers):
            attn = layer.self_attn
            heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
            hd = attn.head_dim
            h = first if three and li == 0 else layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, heads, hd).transpose(1, 2)  # [B, nh, T, hd]
            k = attn.k_proj(h).view(B, T, kv_heads, hd).transpose(1, 2)  # [B, nkv, T, hd]
            v = attn.v_proj(h).view(B, T, kv_heads, hd).transpose(1, 2)
            q, k = _rope(q, cos.to(q.dtype), sin.to(q.dtype)), _rope(k, cos.to(k.dtype), sin.to(k.dtype))
            rep = heads // kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, nh, T, hd]
            kv[li].append((k, v))
            a = _pass_attention(q, k, v, kv[li], d, t_idx, attn.scaling, skip_first=three)
            a = attn.o_proj(a.transpose(1, 2).reshape(B, T, heads * hd))
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        outputs.append(x if three else inner.norm(x))
    return outputs


def _pass_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    passes: list[tuple[torch.Tensor, torch.Tensor]], d: int, t_idx: torch.Tensor,
                    scaling: float, skip_first: bool = False) -> torch.Tensor:
    """Pass d's attention [B, nh, T, hd]: causal over pass 1's keys for d = 1; else pass-1 keys at <= t-d+1
    and, for i = 2..d, the pass-i key at t-d+i (`passes` holds every pass's (k, v) so far, this one's last).
    skip_first (an EAGLE-3 head): no position but 0 reads pass 1's key 0, as served (engine.model.eagle3)."""
    if d == 1 and not skip_first:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    T = q.shape[2]
    if d == 1:  # causal, key 0 read by position 0 only
        allowed = (t_idx.unsqueeze(0) <= t_idx.unsqueeze(1)) & ((t_idx >= 1).unsqueeze(0) | (t_idx == 0).unsqueeze(1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    k1, v1 = passes[0]
    scores = torch.matmul(q, k1.transpose(-1, -2)) * scaling  # [B, nh, T, T]
    allowed = t_idx.unsqueeze(0) <= (t_idx - d + 1).unsqueeze(1)  # key j <= t - d + 1
    if skip_first:  # pass d >= 2 always has its own key to read
        allowed = allowed & (t_idx >= 1).unsqueeze(0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag_scores, diag_values = [], []
    for i in range(2, d + 1):  # pass-i key at t - (d - i)
        ki, vi = passes[i - 1]
        lag = d - i
        if lag:
            ki = torch.cat([ki.new_zeros(ki[:, :, :lag].shape), ki[:, :, :-lag]], dim=2)
            vi = torch.cat([vi.new_zeros(vi[:, :, :lag].shape), vi[:, :, :-lag]], dim=2)
        s = (q * ki).sum(-1, keepdim=True) * scaling  # [B, nh, T, 1]
        s = s.masked_fill((t_idx < lag).view(1, 1, T, 1), float("-inf"))
        diag_scores.append(s)
        diag_values.append(vi)
    probs = torch.softmax(torch.cat([scores, *diag_scores], dim=-1).float(), dim=-1).to(q.dtype)
    a = torch.matmul(probs[..., :T], v1)
    for i, vi in enumerate(diag_values):
        a = a + probs[..., T + i:T + i + 1] * vi
    return a


def readout(model: Any, out: torch.Tensor) -> torch.Tensor:
    """The head's logits over its own rows from a `multi_pass` output: an EAGLE-3 head's after its norm."""
    from engine.model.eagle3 import is_eagle3

    return head_logits(model, model.model.norm(out) if is_eagle3(model) else out)


# ---------------------------------------------------------------------------------------------------- training

@torch.no_grad()
def balance_init(model: Any, target: Any, records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor],
                 sample: int = 8) -> dict[str, float]:
    """Rescale a fresh feature head's fc and residual writes so that the pretrained layers start in their regime.

    The target's features (post final norm) are ~15x the size of its token embeddings, and the residual stream
    its late layers were trained on is ~20x larger again. fc becomes [g I | I] with g = rms(F) / rms(E) (token
    and feature weigh alike), and each head layer's o_proj / down_proj are scaled by s = rms(fc output) / rms of
    the target's residual stream entering the first kept layer, so each layer's update has the relative size it
    had in the target. Serving is unaffected (the same parameters, other values). Returns g and s.
    """
    inner = model.model
    embedding = model.get_input_embeddings().weight.float()
    rms_e = embedding.pow(2).mean().sqrt().item()
    rms_f = torch.cat([f.float() for f in features[:64]]).pow(2).mean().sqrt().item()
    g = rms_f / rms_e
    hidden = inner.fc.out_features
    eye = torch.eye(hidden, device=inner.fc.weight.device, dtype=inner.fc.weight.dtype)
    inner.fc.weight.copy_(torch.cat([g * eye, eye], dim=1))
    inner.fc.bias.zero_()
    layer_input = len(target.model.layers) - len(inner.layers)  # hidden_states index entering the first kept layer
    device = next(target.parameters()).device
    squares = count = 0.0
    for r in records[:sample]:
        ids = torch.tensor([_sequence(r)], device=device)
        state = target.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[layer_input]
        squares += float(state.float().pow(2).sum())
        count += state.numel()
    rms_stream = math.sqrt(squares / count)
    s = rms_f * math.sqrt(2) / rms_stream
    for layer in inner.layers:
        layer.self_attn.o_proj.weight.mul_(s)
        layer.mlp.down_proj.weight.mul_(s)
    return {"embedding_gain": round(g, 4), "residual_scale": round(s, 5), "feature_rms": round(rms_f, 4),
            "embedding_rms": round(rms_e, 5), "target_stream_rms": round(rms_stream, 3)}


@dataclass(frozen=True)
class EagleConfig:
    steps: int = 3000
    batch_tokens: int = 2048  # response positions per optimiser step (about)
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup: float = 0.05
    min_lr: float = 0.1
    amp: str = "bfloat16"
    ckpt_every: int = 100
    depth: int = 2  # unrolled passes per step (training-time test); 1 = teacher-forced only
    depth_decay: float = 0.8  # weight of pass d: depth_decay ** (d - 1)
    feature_weight: float = 0.1  # SmoothL1(h, F) weight next to the soft cross-entropy
    noise: float = 0.0  # uniform noise on the true input features, relative to their RMS
    prompt_weight: float = 0.0  # weight of the cross-entropy at prompt positions (0: response positions only)
    hard_weight: float = 0.0  # EAGLE-3: weight of the cross-entropy to the target's greedy token
    seed: int = 0


def collate(records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor], device: torch.device,
            pad_id: int, prompt_positions: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded ids and features [B, W, H] (row t = F_t), and the positions the cross-entropy is taken at:
    every response position, and with `prompt_positions` the prompt's too (`response` marks which is which)."""
    seqs = [_sequence(r) for r in records]
    width = max(len(s) for s in seqs)
    hidden = features[0].shape[-1]
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    feats = torch.zeros((len(seqs), width, hidden), dtype=torch.float16)
    valid = torch.zeros((len(seqs), width), dtype=torch.bool)
    rows, cols, labels, response = [], [], [], []
    for b, (r, s, f) in enumerate(zip(records, seqs, features)):
        ids[b, :len(s)] = torch.tensor(s)
        feats[b, :len(s)] = f
        valid[b, :len(s)] = True
        start = len(r["prompt"]) - 1
        first = 0 if prompt_positions else start
        rows += [b] * (start - first + len(r["response"]))
        cols += range(first, start + len(r["response"]))
        labels += list(r["prompt"][first + 1:]) + list(r["response"])
        response += [False] * (start - first) + [True] * len(r["response"])
    batch = {"ids": ids.to(device), "features": feats.to(device), "valid": valid.to(device),
             "rows": torch.tensor(rows, device=device), "cols": torch.tensor(cols, device=device),
             "labels": torch.tensor(labels, device=device), "response": torch.tensor(response, device=device)}
    if not prompt_positions and all("topk_ids" in r for r in records):  # the stored labels, row for row
        batch["topk_ids"] = torch.cat([r["topk_ids"] for r in records]).to(device, torch.long)  # [n, k]
        batch["topk_logprobs"] = torch.cat([r["topk_logprobs"] for r in records]).to(device, torch.float32)
    return batch


def losses(model: Any, batch: dict[str, torch.Tensor], config: EagleConfig, cmap: torch.Tensor
           ) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The weighted loss over passes 1..depth, and per pass (ce, feature loss, agreement)."""
    from engine.model.eagle3 import is_eagle3

    if is_eagle3(model):
        return _losses_eagle3(model, batch, config, cmap)
    with autocast(batch["ids"].device, config.amp):
        outs = multi_pass(model, batch["ids"], batch["features"], config.depth, noise=config.noise)
    rows, cols = batch["rows"], batch["cols"]
    target_feat = batch["features"][rows, cols].float()  # [n, H]
    with torch.no_grad():
        logp_t = torch.log_softmax(head_logits(model, target_feat.to(model.model.fc.weight.dtype)).float(), dim=-1)
        p_t = logp_t.exp()
        entropy = -(p_t * logp_t).sum(-1)  # so that the reported loss is KL(p_t || q), 0 at best
    labels = cmap[batch["labels"]]
    weight = torch.where(batch["response"], 1.0, config.prompt_weight)  # [n]
    resp = batch["response"]
    total = torch.zeros((), device=target_feat.device)
    per_pass = []
    for d, out in enumerate(outs, start=1):
        ok = (cols >= d - 1).float() * weight  # pass d exists from position d - 1 on
        h = out[rows, cols]  # [n, H]
        with autocast(batch["ids"].device, config.amp):
            logits = head_logits(model, h)
        logq = torch.log_softmax(logits.float(), dim=-1)
        ce = -(p_t * logq).sum(-1) - entropy
        ce = (ce * ok).sum() / ok.sum().clamp(min=1e-6)
        valid = batch["valid"].clone()
        valid[:, :d - 1] = False
        reg = F.smooth_l1_loss(out.float(), batch["features"].float(), reduction="none").mean(-1)  # [B, T]
        reg = (reg * valid).sum() / valid.sum().clamp(min=1)
        total = total + config.depth_decay ** (d - 1) * (ce + config.feature_weight * reg)
        seen = (cols >= d - 1) & resp  # agreement on response positions only
        agree = ((logits.argmax(-1) == labels) & seen).float().sum() / seen.sum().clamp(min=1)
        per_pass.append({"ce": ce.item(), "feature": reg.item(), "agreement": agree.item()})
    return total, per_pass


def _losses_eagle3(model: Any, batch: dict[str, torch.Tensor], config: EagleConfig, cmap: torch.Tensor
                   ) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """An EAGLE-3 head's loss: per pass, KL from the target's stored top-k (renormalised over the head's rows)
    + `hard_weight` x cross-entropy to the target's greedy token (where the head can emit it); no feature
    regression. Response positions only; agreement with the target's greedy token (a sampled record's
    response is not it)."""
    with autocast(batch["ids"].device, config.amp):
        outs = multi_pass(model, batch["ids"], batch["features"], config.depth, noise=config.noise)
    rows, cols = batch["rows"], batch["cols"]
    columns = cmap[batch["topk_ids"]]  # [n, k], -1 outside the head
    present = columns >= 0
    p_t = torch.softmax(batch["topk_logprobs"].masked_fill(~present, float("-inf")), dim=-1)
    p_t = torch.nan_to_num(p_t, nan=0.0)  # no top-k token in the head: no soft label
    entropy = -(p_t * torch.log(p_t.clamp(min=1e-30))).sum(-1)  # so that the soft term is KL(p_t || q)
    greedy = columns[:, 0]
    total = torch.zeros((), device=rows.device)
    per_pass = []
    for d, out in enumerate(outs, start=1):
        ok = (cols >= d - 1).float()  # pass d exists from position d - 1 on
        with autocast(batch["ids"].device, config.amp):
            logits = readout(model, out[rows, cols])
        logq = torch.log_softmax(logits.float(), dim=-1)
        kl = -(p_t * logq.gather(-1, columns.clamp(min=0))).masked_fill(~present, 0.0).sum(-1) - entropy
        hard = -logq.gather(-1, greedy.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (greedy >= 0)
        kl, hard = (kl * ok).sum() / ok.sum().clamp(min=1), (hard * ok).sum() / ok.sum().clamp(min=1)
        total = total + config.depth_decay ** (d - 1) * (kl + config.hard_weight * hard)
        agree = ((logits.argmax(-1) == greedy).float() * ok).sum() / ok.sum().clamp(min=1)
        per_pass.append({"ce": kl.item(), "hard": hard.item(), "agreement": agree.item()})
    return total, per_pass


def train(model: Any, records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor], config: EagleConfig,
          ckpt: Path, *, pad_id: int, vocab: int, budget_s: float | None = None) -> dict[str, Any]:
    """Train the feature head `model` (from build_feature_head) in place; a summary (as distill.train.train)."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    step, history, config = resume(ckpt, model, optimizer, config)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    cmap = column_map(model, vocab, device)
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed + step)
    batches, epoch = replay_batches(records, config.batch_tokens, rng, step)
    model.train()
    started, first_step = time.monotonic(), step
    window: list[tuple[float, list[dict[str, float]], int]] = []
    with tqdm(total=config.steps, initial=step, desc="training (eagle)", unit="step", mininterval=10) as bar:
        while step < config.steps:
            if not batches:
                batches = make_batches(records, config.batch_tokens, rng)
                epoch += 1
            chunk = batches.pop()
            batch = collate([records[i] for i in chunk], [features[i] for i in chunk], device, pad_id,
                            prompt_positions=config.prompt_weight > 0)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, config)
            loss, per_pass = losses(model, batch, config, cmap)
            optimizer_step(loss, optimizer, params)
            step += 1
            config = fit_to_budget(config, step, first_step, started, budget_s, bar, probe=10)
            window.append((loss.item(), per_pass, int(batch["response"].sum())))
            if step % 10 == 0 or step == config.steps:
                n = sum(w[2] for w in window)
                entry: dict[str, Any] = {"step": step, "epoch": epoch,
                                         "loss": round(sum(w[0] * w[2] for w in window) / n, 4),
                                         "lr": lr_at(step - 1, config)}
                for d in range(config.depth):
                    for key in window[0][1][d]:  # ce, feature (EAGLE-1) or hard (EAGLE-3), agreement
                        entry[f"{key}_{d + 1}"] = round(sum(w[1][d][key] * w[2] for w in window) / n, 4)
                history.append(entry)
                bar.set_postfix(loss=f"{entry['loss']:.3f}", agree=f"{entry['agreement_1']:.3f}", epoch=epoch)
                if step % 100 == 0:
                    log.info("step %d/%d: %s", step, config.steps, entry)
                window = []
            bar.update(1)
            if step % config.ckpt_every == 0 or step == config.steps:
                save_checkpoint(ckpt, model, optimizer, step, history, config)
    model.eval()
    return {"steps": step, "epochs": epoch, "seconds": round(time.monotonic() - started, 1),
            "history": history, "config": asdict(config)}


# ---------------------------------------------------------------------------------------------------- evaluation

@torch.inference_mode()
def correctness(model: Any, records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor], depth: int = 8,
                batch_tokens: int = 4096) -> list[torch.Tensor]:
    """Per record, bool [depth, len(response)]: entry [d-1, j] = the head's pass-d greedy token for response[j]
    is right (its draft of depth d from the start j - d + 1; False where that start is before the response)."""
    device = next(model.parameters()).device
    subset = subset_of(model)
    order = sorted(range(len(records)), key=lambda i: len(_sequence(records[i])))
    out: list[torch.Tensor | None] = [None] * len(records)
    b = 0
    while b < len(order):
        e = b + 1
        while e < len(order) and (e - b + 1) * len(_sequence(records[order[e]])) <= batch_tokens:
            e += 1
        chunk = order[b:e]
        batch = collate([records[i] for i in chunk], [features[i] for i in chunk], device, 0)
        outs = multi_pass(model, batch["ids"], batch["features"], depth)
        for j, i in enumerate(chunk):
            r = records[i]
            start, m = len(r["prompt"]) - 1, len(r["response"])
            rows = []
            for d, o in enumerate(outs):
                guess = readout(model, o[j, start:start + m]).float().argmax(-1)
                if subset is not None:
                    guess = subset[guess]
                ok = guess.cpu() == torch.tensor(r["response"])
                ok[:d] = False  # a depth-(d+1) draft for response[j] starts at j - d, before the response
                rows.append(ok)
            out[i] = torch.stack(rows)
        b = e
    return out  # type: ignore[return-value]


def accepted_runs(table: torch.Tensor, k: int) -> list[int]:
    """For each start s of one record: how many of k greedy drafts are accepted (table from `correctness`)."""
    depth, m = table.shape
    runs = []
    for s in range(m):
        a = 0
        while a < min(k, depth) and s + a < m and bool(table[a, s + a]):
            a += 1
        runs.append(a)
    return runs


def simulate(tables: Sequence[torch.Tensor], k: int) -> float:
    """Tokens per target pass of greedy speculative decoding with k drafts per round (exact, per record)."""
    tokens = passes = 0
    for table in tables:
        runs = accepted_runs(table, k)
        m, pos = table.shape[1], 0
        while pos < m:
            step = min(runs[pos] + 1, m - pos)
            pos += step
            tokens += step
            passes += 1
    return tokens / passes if passes else 0.0


def quality(model: Any, records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor],
            ks: Sequence[int] = range(1, 9)) -> dict[str, Any]:
    tables = correctness(model, records, features, depth=max(ks))
    positions = sum(t.shape[1] for t in tables)
    agreement = sum(int(t[0].sum()) for t in tables) / max(positions, 1)
    runs = [a for t in tables for a in accepted_runs(t, max(ks))]
    depth_acceptance = {}
    for d in range(1, max(ks) + 1):
        reached = sum(a >= d - 1 for a in runs)
        depth_acceptance[d] = round(sum(a >= d for a in runs) / max(reached, 1), 4)
    return {"positions": positions, "agreement": round(agreement, 4),
            "depth_acceptance": depth_acceptance,  # P(draft d accepted | drafts 1..d-1 were), over all starts
            "tokens_per_pass": {k: round(simulate(tables, k), 3) for k in ks}}


@torch.inference_mode()
def chain(model: Any, record: dict[str, Any], features: torch.Tensor, start: int, k: int) -> int:
    """Accepted drafts from response position `start`, drafted sequentially as a service would (DynamicCache)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    subset = subset_of(model)
    inner = model.model
    seq = _sequence(record)
    n = len(record["prompt"]) - 1 + start  # the last committed position
    ids = torch.tensor([seq[:n + 1]], device=device)
    feats = _shift(features[None, :n + 1].to(device, inner.fc.weight.dtype))
    cache = DynamicCache(config=model.config)
    x = inner.fc(torch.cat([model.get_input_embeddings()(ids), feats], -1))
    h = inner(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state[:, -1:]  # [1, 1, H]
    accepted = 0
    for i in range(k):
        column = head_logits(model, h[0, -1]).float().argmax(-1)
        token = int(subset[column]) if subset is not None else int(column)
        if start + i >= len(record["response"]) or token != record["response"][start + i]:
            break
        accepted += 1
        x = inner.fc(torch.cat([model.get_input_embeddings()(torch.tensor([[token]], device=device)), h], -1))
        pos = torch.tensor([[n + 1 + i]], device=device)
        h = inner(inputs_embeds=x, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
    return accepted


def chain_check(model: Any, records: Sequence[dict[str, Any]], features: Sequence[torch.Tensor], *,
                starts: int = 200, k: int = 8, seed: int = 0) -> dict[str, Any]:
    """Sequential chains from sampled starts vs the batched table: mean accepted drafts and how often they match."""
    rng = random.Random(seed)
    picks = [(i, rng.randrange(len(records[i]["response"]))) for i in
             (rng.randrange(len(records)) for _ in range(starts))]
    tables = {i: correctness(model, [records[i]], [features[i]], depth=k)[0] for i in {i for i, _ in picks}}
    seq_runs, table_runs = [], []
    for i, s in picks:
        seq_runs.append(chain(model, records[i], features[i], s, k))
        table_runs.append(accepted_runs(tables[i], k)[s])
    same = sum(a == b for a, b in zip(seq_runs, table_runs)) / len(picks)
    return {"starts": len(picks), "k": k, "mean_accepted_sequential": round(statistics.mean(seq_runs), 3),
            "mean_accepted_batched": round(statistics.mean(table_runs), 3), "same_run_fraction": round(same, 4)}


@torch.inference_mode()
def cost(model: Any, target: Any, context: list[int], features: torch.Tensor, *, repeats: int = 30) -> dict[str, Any]:
    """Median ms of one head draft step (fc + layers + subset head + argmax, on a cache) vs one target step."""
    from transformers import DynamicCache

    from distill.evaluate import _step_ms

    device = next(model.parameters()).device
    inner = model.model
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([context], device=device)
    feats = _shift(features[None, :len(context)].to(device, inner.fc.weight.dtype))
    inner(inputs_embeds=inner.fc(torch.cat([model.get_input_embeddings()(ids), feats], -1)), cache=cache,
          use_cache=True)
    new = torch.tensor([context[-1:]], device=device)
    feat = feats[:, -1:]
    pos = torch.tensor([[len(context)]], device=device)

    def head_step() -> list[float]:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            x = inner.fc(torch.cat([model.get_input_embeddings()(new), feat], -1))
            h = inner(inputs_embeds=x, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
            head_logits(model, h[0, -1]).float().argmax(-1).item()
            times.append((time.perf_counter() - started) * 1e3)
            cache.crop(-1)
        return times

    head_ms, target_ms = [], []
    for _ in range(3):
        head_ms += head_step()
        target_ms += _step_ms(target, context, 1, repeats)
    d1, t1 = statistics.median(head_ms), statistics.median(target_ms)
    return {"draft_ms": round(d1, 3), "target_ms": round(t1, 3), "c": round(d1 / t1, 4), "context": len(context)}


# ---------------------------------------------------------------------------------------------------- CLI stages

def feature_cache(args: Any, name: str) -> Path:
    return Path(args.out) / FEATURES / name


def run_train(args: Any) -> dict[str, Any]:
    """`python -m distill train --kind eagle`: features (cached), then the head -> OUT/draft (kind eagle).

    --train-minutes bounds feature extraction and training together.
    """
    import json

    from distill import data, sources
    from distill.train import choose_subset
    from engine.model import drafts

    started = time.monotonic()
    records = data.load_records(Path(args.out) / "data" / "train")
    if not records:
        raise SystemExit(f"no training data under {Path(args.out) / 'data' / 'train'}: run the data stage first")
    info = json.loads((Path(args.out) / "data" / "info.json").read_text())
    feature_dtype = sources.fast_dtype(args.feature_dtype, args.device)
    extractor = sources.load_target(args, feature_dtype)
    pad = extractor.tokenizer.pad_token_id if extractor.tokenizer.pad_token_id is not None \
        else extractor.eos_token_ids[0]
    records, features, feature_summary = cached_features(
        extractor.model, Path(args.out) / "data" / "train", feature_cache(args, "train"), dtype=feature_dtype,
        pad_id=pad)
    feature_summary["greedy_fidelity"] = round(feature_fidelity(extractor.model, records, features), 4)
    log.info("train features reproduce the records' greedy tokens at %.2f%% of response positions",
             100 * feature_summary["greedy_fidelity"])
    del extractor
    target = sources.load_target(args, "float32")
    model, vocab = target.model, target.vocab_size
    subset = None
    if 0 < args.vocab < vocab:
        subset = choose_subset(records, args.vocab, vocab, always=target.eos_token_ids)
    reference = sources.load_target(args, "float32").model
    drafts.build_feature_head(model, args.layers, subset)
    init = balance_init(model, reference, records, features)
    del reference
    log.info("head init: %s", init)
    config = EagleConfig(steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr,
                         amp=sources._amp(args, target.device), depth=args.depth, feature_weight=args.feature_weight,
                         noise=args.feature_noise, prompt_weight=args.prompt_weight, seed=args.seed)
    budget = None
    if args.train_minutes > 0:
        budget = max(60.0, 60 * args.train_minutes - (time.monotonic() - started))
    log.info("training a %d-layer feature head (%s head, %d trainable parameters, depth %d) on %d sequences / "
             "%d response tokens / %d positions, amp %s, budget %s s", args.layers,
             f"{subset.numel()}-row" if subset is not None else "full",
             sum(p.numel() for p in drafts.trainable_parameters(model)), config.depth, len(records),
             sum(len(r["response"]) for r in records), feature_summary["tokens"], config.amp,
             None if budget is None else round(budget))
    summary = train(model, records, features, config, Path(args.out) / "train" / "eagle-checkpoint.pt",
                    pad_id=pad, vocab=vocab, budget_s=budget)
    config = EagleConfig(**summary["config"])
    manifest = drafts.Manifest(
        target=drafts.target_spec(sources._target_loader_spec(args.target_model)),
        target_name=target.name,
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        num_layers=args.layers,
        vocab_subset=int(subset.numel()) if subset is not None else 0,
        dtype=args.draft_dtype,
        kind=drafts.EAGLE,
        recipe={
            "method": "EAGLE-style feature head: soft cross-entropy to softmax(lm_head(F)) of the target's "
                      f"teacher-forced features + {config.feature_weight} x SmoothL1(h, F), {config.depth} unrolled "
                      "pass(es) on its own features (training-time test)",
            "init": {"description": f"fc = [g I | I] (g = rms(F) / rms(embedding)); the target's last "
                                    f"{args.layers} decoder layer(s), o_proj / down_proj x s (s = rms(fc output) / "
                                    "rms of the target's residual stream there) + final norm; frozen tied head",
                     **init},
            "data": {k: info[k] for k in ("train", "heldout", "heldout_v2", "heldout_file", "max_new_tokens")
                     if k in info},
            "features": feature_summary,
            "prompts": "distill/prompt_sets/distill_prompts.jsonl" if args.prompt_file is None
            else str(args.prompt_file),
            "train": {**asdict(config), "epochs": summary["epochs"], "seconds": summary["seconds"],
                      "stage_seconds": round(time.monotonic() - started, 1),
                      "final": summary["history"][-1] if summary["history"] else {}},
        },
    )
    out = drafts.save(model, Path(args.out) / "draft", manifest)
    log.info("feature head written to %s", out)
    return summary


def run_eval(args: Any) -> dict[str, Any]:
    """`python -m distill eval --kind eagle`: both held-out sets, per-depth acceptance, tokens/pass, cost."""
    import json

    from distill import evaluate, sources
    from engine.model import drafts, loader

    sets = sources.heldout_records(args)
    folder = args.draft_model or Path(args.out) / "draft"
    trained = loader.load(str(folder), device=args.device, dtype=args.draft_dtype)
    if not trained.feature_dim:
        raise SystemExit(f"{folder} is not a feature head (kind eagle)")
    target = sources.load_target(args, "float32")
    pad = sources.pad_id(target)
    subset = subset_of(trained.model)
    result: dict[str, Any] = {"draft_folder": str(folder), "kind": drafts.EAGLE, "dtype": args.draft_dtype,
                              "sets": {}, "by_set": {}}
    features = {}
    for name, records in sets.items():
        records, feats, _ = cached_features(target.model, Path(args.out) / "data" / name, feature_cache(args, name),
                                            dtype="float32", pad_id=pad)
        features[name] = (records, feats)
        log.info("evaluating the feature head on %d %s responses", len(records), name)
        started = time.monotonic()
        q = quality(trained.model, records, feats)
        q["vocab_coverage"] = round(evaluate.coverage(records, subset), 4)
        q["seconds"] = round(time.monotonic() - started, 1)
        result["by_set"][name] = q
        result["sets"][name] = {"prompts": len(records), "positions": q["positions"]}
        log.info("%s: agreement %.1f%%, depth acceptance %s, tokens/pass %s", name, 100 * q["agreement"],
                 q["depth_acceptance"], q["tokens_per_pass"])
    check_set = "heldout_v2" if "heldout_v2" in features else "heldout"
    result["chain_check"] = {"set": check_set, **chain_check(trained.model, *features[check_set], seed=args.seed)}
    log.info("sequential chain check: %s", result["chain_check"])
    records, feats = features["heldout"]
    context = _sequence(records[0])[:256]
    result["cost"] = cost(trained.model, target.model, context, feats[0])
    log.info("cost: head step %.2f ms vs target %.2f ms (c = %.3f)", result["cost"]["draft_ms"],
             result["cost"]["target_ms"], result["cost"]["c"])
    result["threads"] = torch.get_num_threads()
    result |= {k: result["by_set"]["heldout"][k] for k in ("agreement", "tokens_per_pass", "depth_acceptance")}
    out = Path(args.out) / ("eval.json" if args.draft_model is None else f"eval-{Path(folder).name}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.draft_model is None:
        summary = {k: result[k] for k in ("agreement", "tokens_per_pass", "depth_acceptance", "cost",
                                          "chain_check")}
        summary["heldout_positions"] = result["by_set"]["heldout"]["positions"]
        summary["vocab_coverage"] = {k: v["vocab_coverage"] for k, v in result["by_set"].items()}
        if "heldout_v2" in result["by_set"]:
            v2 = result["by_set"]["heldout_v2"]
            summary["heldout_v2"] = {k: v2[k] for k in ("agreement", "tokens_per_pass", "depth_acceptance",
                                                        "positions")}
        manifest = drafts.Manifest.read(folder)
        drafts.Manifest(**{**manifest.__dict__, "eval": summary}).write(folder)
    return result

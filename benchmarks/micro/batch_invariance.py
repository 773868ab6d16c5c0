"""Batch invariance of the batched target on the suite prompts (embedded target, in-process).

Two measurements, each with the invariance measure (each matrix product's rows
padded where its kernel needs it, engine.model.linear.calibrate) and without it:

  teacher-forced  every prompt, then its greedy continuation fed back in steps
                  (`decode`: 1 token per step; `score`: 1..5 tokens per step, like
                  Score with k drafts); a session runs alone, then among 8 and 16
                  sessions that join and leave at random (70 % take part in each
                  forward). A flip is a position whose argmax differs from the
                  session run alone (and from the stock transformers forward).
  end to end      greedy decoding through the scheduler (ModelHost +
                  target_service.scoring, so within the service's forward limits)
                  with 1, 8 and 16 concurrent streams; sequences compared with
                  the stock greedy loop (= generate) and with one stream at a time.
  The teacher-forced part packs whole prompts into one forward, beyond the
  service's --max-batch-tokens: in bfloat16 the oneDNN kernels change with the
  row count up to about a thousand rows, so there only the end-to-end part
  stays within the calibrated range.

  python -m benchmarks.micro.batch_invariance [--prompts 16] [--tokens 32] [--dtype bfloat16] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch

SUITE = Path(__file__).resolve().parents[1] / "prompts" / "suite-v1.jsonl"


def suite_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
    rows = [rows[i] for i in range(0, len(rows), max(1, len(rows) // n))][:n]  # spread over categories
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text)["input_ids"])
    return out


def stock_greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation with a DynamicCache, one token per step; also its logits [tokens, vocab]."""
    from transformers import DynamicCache

    from engine.stock import cache_kwarg

    cache = DynamicCache(config=model.config)
    kw = cache_kwarg(model)
    logits = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0]
    out, rows = [], [logits]
    for i in range(tokens - 1):
        out.append(int(rows[-1][-1].argmax()))
        pos = len(prompt) + i
        rows.append(model(input_ids=torch.tensor([[out[-1]]]), position_ids=torch.tensor([[pos]]),
                          use_cache=True, **{kw: cache}).logits[0])
    out.append(int(rows[-1][-1].argmax()))
    return out, torch.cat(rows)


def teacher_forced(runner, prompts, steps, groups, seed: int) -> dict[int, torch.Tensor]:
    """Logits of every continuation position, sessions of a group sharing forwards."""
    from engine.plan import RowPlan, StepPlan

    rng = random.Random(seed)
    out = {}
    for group in groups:
        caches = {i: runner.new_cache() for i in group}
        at = {i: 0 for i in group}
        got: dict[int, list[torch.Tensor]] = {i: [] for i in group}
        while any(at[i] < len(steps[i]) for i in group):
            live = [i for i in group if at[i] < len(steps[i])]
            take = [i for i in live if len(groups[0]) == 1 or rng.random() < 0.7] or live[:1]
            rows = []
            for i in take:
                tokens = steps[i][at[i]]
                caches[i].reserve(caches[i].length + len(tokens))
                rows.append(RowPlan(caches[i], tokens, caches[i].length, len(tokens)))
            logits = runner.logits(StepPlan(rows)).float()
            offset = 0
            for i, row in zip(take, rows):
                got[i].append(logits[offset:offset + row.emit])
                offset += row.emit
                at[i] += 1
        for i in group:
            out[i] = torch.cat(got[i])[len(prompts[i]) - 1:]  # [continuation, vocab]
            caches[i].free()
    return out


def compare(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict:
    return {
        "flips": sum(int((a[i].argmax(-1) != b[i].argmax(-1)).sum()) for i in a),
        "positions": sum(int(a[i].shape[0]) for i in a),
        "max_abs_logit_diff": max(float((a[i] - b[i]).abs().max()) for i in a),
        "bitwise": all(torch.equal(a[i], b[i]) for i in a),
    }


async def decode_streams(host, prompts: list[list[int]], tokens: int, concurrent: int) -> list[list[int]]:
    """Greedy decoding through the batching worker: Score(k=0) per token, `concurrent` streams at once."""
    from specdec.core.fingerprint import fingerprint
    from specdec.core.sampling import SamplingParams
    from model_service.requests import ModelRequest
    from target_service.scoring import score

    async def stream(i: int) -> list[int]:
        committed, held, out = list(prompts[i]), 0, []
        for _ in range(tokens):
            req = ModelRequest(f"e2e-{concurrent}-{i}", held, fingerprint(committed[:held]), committed[held:], 0,
                               SamplingParams(), False)
            done = await score(host, req)
            out.append(done.value.argmax_ids[-1])
            held = len(committed)
            committed.append(out[-1])
        return out

    results: list[list[int]] = []
    for start in range(0, len(prompts), concurrent):
        results += await asyncio.gather(*[stream(i) for i in range(start, min(start + concurrent, len(prompts)))])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (the target's weights and KV)")
    parser.add_argument("--end-to-end-only", action="store_true", help="skip the teacher-forced part")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from engine.model.loader import load

    lm = load(None, dtype=args.dtype)
    prompts = suite_prompts(lm.tokenizer, args.prompts)
    results: dict = {"prompts": len(prompts), "tokens": args.tokens, "dtype": args.dtype,
                     "prompt_lengths": [len(p) for p in prompts]}
    refs = _references(lm.model, prompts, args.tokens, results)
    _teacher_forced_part(lm.model, prompts, refs, [] if args.end_to_end_only else
                         ["padded (measure)", "unpadded (no measure)"], results)
    lm = load(None, dtype=args.dtype)  # a fresh copy: the engine takes the model's linear weights
    _end_to_end_part(lm, prompts, refs, args.tokens, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _references(model, prompts: list[list[int]], tokens: int, results: dict) -> list[tuple[list[int], torch.Tensor]]:
    """The stock greedy loop per prompt (tokens, logits); checked once against `generate`."""
    started = time.monotonic()
    with torch.inference_mode():
        refs = [stock_greedy(model, p, tokens) for p in prompts]
        generated = model.generate(torch.tensor([prompts[0]]), max_new_tokens=tokens, min_new_tokens=tokens,
                                   do_sample=False)[0, len(prompts[0]):].tolist()
    results["stock_loop_equals_generate_on_prompt_0"] = generated == refs[0][0]
    print(f"references in {time.monotonic() - started:.0f} s; generate agrees: {generated == refs[0][0]}", flush=True)
    return refs


def _schedules(prompts: list[list[int]], refs) -> dict[str, list[list[list[int]]]]:
    """Per mode, each prompt's steps: the prompt, then its continuation 1 (decode) or 1..5 (score)
    tokens at a time."""
    rng = random.Random(0)
    schedules = {}
    for mode in ("decode", "score"):
        steps = []
        for p, (seq, _) in zip(prompts, refs):
            chunks, j = [list(p)], 0
            while j < len(seq) - 1:
                n = 1 if mode == "decode" else rng.randint(1, 5)
                chunks.append(seq[j:min(j + n, len(seq) - 1)])
                j += n
            steps.append(chunks)
        schedules[mode] = steps
    return schedules


def _teacher_forced_part(model, prompts: list[list[int]], refs, measures: list[str], results: dict) -> None:
    """Flips against the session alone and the stock forward, with and without the measure."""
    from engine.model.linear import calibrate
    from engine.model.llama import LlamaForward
    from engine.runner import PooledRunner

    schedules = _schedules(prompts, refs)
    stock = {i: logits.float() for i, (_, logits) in enumerate(refs)}
    everyone = list(range(len(prompts)))
    forward = LlamaForward(model)
    calibration = calibrate(forward.linears(), 320)
    results["calibration"] = calibration.describe()
    print(f"calibrated pads: {calibration.describe()}", flush=True)
    pads = [lin.pad_to for lin in forward.linears()]
    runner = PooledRunner(forward, forward.new_pool(1 << 30), fixed_shapes=False, max_rows=64)
    for measure in measures:
        for lin, pad in zip(forward.linears(), pads):
            lin.pad_to = pad if measure.startswith("padded") else 1
        for mode, steps in schedules.items():
            t0 = time.monotonic()
            with torch.inference_mode():
                alone = teacher_forced(runner, prompts, steps, [[i] for i in everyone], seed=1)
                row = {"alone_vs_stock": compare(alone, stock)}
                for size in (8, 16):
                    groups = [everyone[j:j + size] for j in range(0, len(everyone), size)]
                    batched = teacher_forced(runner, prompts, steps, groups, seed=size)
                    row[f"batch{size}_vs_alone"] = compare(batched, alone)
                    row[f"batch{size}_vs_stock"] = compare(batched, stock)
            results[f"teacher-forced {mode} | {measure}"] = row
            print(f"[{mode} | {measure}] ({time.monotonic() - t0:.0f} s)", flush=True)
            for key, v in row.items():
                print(f"    {key:16s} flips {v['flips']:3d}/{v['positions']}  max|dlogit| "
                      f"{v['max_abs_logit_diff']:.2e}  bitwise {v['bitwise']}", flush=True)


def _end_to_end_part(lm, prompts: list[list[int]], refs, tokens: int, results: dict) -> None:
    """Greedy decoding through the scheduler with 1, 8 and 16 concurrent streams."""
    from engine.host import HostLimits, ModelHost

    host = ModelHost(lm, HostLimits(max_batch=16))
    assert host.max_batch == 16, "the engine's pooled forward refused this model (see the log)"
    try:
        lone: list[list[int]] = []
        for concurrent in (1, 8, 16):
            t0 = time.monotonic()
            seqs = asyncio.run(decode_streams(host, prompts, tokens, concurrent))
            lone = lone or seqs
            same = sum(s == ref for s, (ref, _) in zip(seqs, refs))
            as_alone = sum(s == a for s, a in zip(seqs, lone))
            results[f"end_to_end_{concurrent}_streams_identical"] = f"{same}/{len(prompts)}"
            results[f"end_to_end_{concurrent}_streams_as_alone"] = f"{as_alone}/{len(prompts)}"
            print(f"end to end, {concurrent:2d} concurrent streams: {same}/{len(prompts)} sequences identical to "
                  f"the stock greedy loop, {as_alone}/{len(prompts)} to one stream at a time "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        host.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

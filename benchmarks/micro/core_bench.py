"""Micro-benchmark of the core: verify() per call and prompt lookup per round.

    python -m benchmarks.micro.core_bench [--vocab 49152] [--history 20000] [--threads 1] [--device cpu]

Prints median (and p90) wall time of verify_greedy / verify_sampled for k = 1,
4, 8 (greedy: token-id comparison, plus the sampled verifier on one-hot rows;
sampling: a draft model's q and a one-hot proposer, both at a rejection-heavy
and an all-accepted operating point), the batch verifier for 16 sessions at
k = 4, and PromptLookup propose + extend per round at the given history
length. The goal (issue 2): verify k = 4 sampling < 1 ms, lookup < 50 us/round.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from specdec.core.lookup import PromptLookup
from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.core.verify import verify_greedy, verify_sampled, verify_sampled_batch


def timeit(fn: Callable[[], object], *, repeat: int, device: torch.device) -> tuple[float, float]:
    """(median, p90) seconds per call."""
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def fmt(seconds: tuple[float, float]) -> str:
    med, p90 = seconds
    return f"{med * 1e6:9.1f} us  (p90 {p90 * 1e6:8.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--history", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    print(f"core_bench: vocab={args.vocab} threads={args.threads} device={device} torch={torch.__version__}")

    print("\nverify() per call")
    for k in (1, 4, 8):
        target_logits = torch.randn(k + 1, args.vocab, generator=gen).to(device) * 3  # [k + 1, vocab]
        draft_logits = (target_logits[:k] + torch.randn(k, args.vocab, generator=gen).to(device))  # [k, vocab]
        p = probs_from_logits(target_logits, params)
        q = probs_from_logits(draft_logits, params)
        argmax = target_logits.argmax(-1).tolist()
        p_greedy = probs_from_logits(target_logits, SamplingParams())
        sampled = torch.multinomial(q.cpu(), 1, generator=gen).squeeze(-1).tolist()
        matching = argmax[:k]  # drafted tokens the target accepts (greedy rows)
        rows = [
            ("greedy    verify_greedy (ids)", lambda: verify_greedy(matching, argmax)),
            ("greedy    verify_sampled one-hot p", lambda: verify_sampled(matching, None, p_greedy, seed=1, position=100)),
            ("sampling  draft q, drafted ~ q", lambda: verify_sampled(sampled, q, p, seed=1, position=100)),
            ("sampling  draft q, all accepted", lambda: verify_sampled(sampled, p[:k], p, seed=1, position=100)),
            ("sampling  one-hot (lookup/guess)", lambda: verify_sampled(sampled, None, p, seed=1, position=100)),
        ]
        for name, fn in rows:
            print(f"  k={k}  {name:36s} {fmt(timeit(fn, repeat=args.repeat, device=device))}")

    print("\nprobs_from_logits per call (what a service runs before shipping p or q)")
    for k in (1, 4, 8):
        logits = torch.randn(k + 1, args.vocab, generator=gen).to(device)  # [k + 1, vocab]
        for name, sp in [("temperature 0.8", SamplingParams(0.8)), ("t 0.8, top-p 0.95", params),
                         ("t 0.8, top-k 50", SamplingParams(0.8, top_k=50))]:
            t = timeit(lambda: probs_from_logits(logits, sp), repeat=max(20, args.repeat // 3), device=device)
            print(f"  {k + 1} rows  {name:36s} {fmt(t)}")

    sessions = 16
    k = 4
    ps = [probs_from_logits(torch.randn(k + 1, args.vocab, generator=gen).to(device) * 3, params) for _ in range(sessions)]
    qs = [probs_from_logits(torch.randn(k, args.vocab, generator=gen).to(device) * 3, params) for _ in range(sessions)]
    ds = [torch.multinomial(q.cpu(), 1, generator=gen).squeeze(-1).tolist() for q in qs]
    batch = timeit(
        lambda: verify_sampled_batch(ds, qs, ps, seeds=list(range(sessions)), positions=[100] * sessions),
        repeat=max(20, args.repeat // 5), device=device,
    )
    print(f"  batch of {sessions} sessions, k=4 sampling        {fmt(batch)}  = {batch[0] / sessions * 1e6:.1f} us/session")

    print(f"\nprompt lookup per round at {args.history} tokens of history (propose + extend by 3)")
    rnd = random.Random(0)
    # Text-like history: a small vocabulary of frequent ids so n-grams recur.
    history = [rnd.randrange(2000) for _ in range(args.history)]
    pl = PromptLookup()
    start = time.perf_counter()
    pl.extend(history)
    build = time.perf_counter() - start
    new_tokens = [rnd.randrange(2000) for _ in range(3 * (args.repeat * 12))]
    it = iter(range(0, len(new_tokens), 3))

    def one_round() -> None:
        pl.propose()
        i = next(it)
        pl.extend(new_tokens[i : i + 3])

    print(f"  PromptLookup round                          {fmt(timeit(one_round, repeat=args.repeat * 10, device=torch.device('cpu')))}")
    print(f"  PromptLookup.propose only                   {fmt(timeit(pl.propose, repeat=args.repeat * 10, device=torch.device('cpu')))}")
    print(f"  (index build for {args.history} tokens: {build * 1e3:.1f} ms once per session)")


if __name__ == "__main__":
    main()

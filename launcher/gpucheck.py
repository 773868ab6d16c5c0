"""The engine's device check: what needs a GPU to be known, in one process, in minutes.

    python -m launcher.gpucheck OUT_DIR [--device cuda:0] [--quick]
    scripts/gpu-check OUT_DIR                       (the same, from the repository)

No gRPC, no Redis, no model download: the model is SmolLM2-135M-shaped, built on
the device from the config this package carries (launcher/data), with random
weights of a wide spread so that argmaxes are decisive. Each phase appends one
JSON line to OUT_DIR/phases.jsonl as soon as it ends (so a run cut short still
says how far it got), then OUT_DIR/report.md sums them up:

  env            torch, transformers, CUDA, the device and its memory
  cached         the engine's cached decoding vs a full recompute of the sequence
  selfcheck      calibration of the linears and the start-up checks of a target (engine.host:
                 the verify shapes proven bitwise) in fp32, bf16 and fp16, and the attention
                 dtype each settled on
  invariance     a session's logits alone vs packed with 1 .. 256 rows, bitwise, every dtype
  score_steps    Score over k + 1 tokens vs k + 1 one-token steps, bitwise, every dtype
  identity       greedy speculative decoding in-process (corrupted drafts verified by Score,
                 all sessions in one forward per round) against target-only decoding, and a
                 token tree's path against the same tokens decoded one at a time, at 1, 8 and
                 64 concurrent sessions, in bf16 and fp16
  timing(_compiled)  forward time per step (CUDA events on a GPU) for 1 / 4 / 16 sessions,
                 decode and k + 1 = 5, against the model's own forward at one session;
                 on a GPU again with --compile (CUDA graphs)
  oom            a real out-of-memory in a forward: idle sessions evicted, retried, then
                 RESOURCE_EXHAUSTED, and served again once memory is back (GPU only)
  top_p          top-p distributions: the same bits on every repeat, the same kept set as on the CPU

--quick (the CI dry run on a CPU) keeps every phase but shrinks the model to 2
layers and the token counts. Exit status: 0 all phases passed, 1 a phase failed,
2 the device is not there.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CONFIG = Path(__file__).resolve().parent / "data" / "smollm2-135m-config.json"
BUDGET_S = 6 * 60


def build_model(device: torch.device, dtype: torch.dtype, layers: int | None, seed: int = 0) -> Any:
    """SmolLM2-135M's architecture with random weights (std 1/sqrt(fan-in)) on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(CONFIG.read_text())
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def loaded_of(model: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from engine.model.loader import LoadedModel

    config = model.config
    return LoadedModel(model=model, tokenizer=None, name="smollm2-135m-shaped", path=CONFIG.parent,
                       vocab_size=int(config.vocab_size), context_length=int(config.max_position_embeddings),
                       eos_token_ids=(int(config.eos_token_id),), tokenizer_fingerprint="",
                       parameter_count=sum(p.numel() for p in model.parameters()),
                       num_layers=int(config.num_hidden_layers), device=device, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Check:
    """Runs phases under the time budget and writes each one's JSON line as it ends."""

    def __init__(self, out: Path, device: torch.device, quick: bool):
        self.out, self.device, self.quick = out, device, quick
        self.started = time.monotonic()
        self.results: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        self.lines = (out / "phases.jsonl").open("w")

    def phase(self, name: str, fn: Callable[[], dict]) -> None:
        left = BUDGET_S - (time.monotonic() - self.started)
        record: dict[str, Any] = {"phase": name}
        if left <= 0:
            record.update(status="skipped", reason="time budget spent")
        else:
            t0 = time.monotonic()
            try:
                figures = fn()
                ok = figures.pop("ok", True)
                record.update(status="passed" if ok else "failed", **figures)
            except Exception as exc:  # a phase's failure is a finding, not the end of the check
                record.update(status="error", error=f"{type(exc).__name__}: {exc}",
                              traceback=traceback.format_exc(limit=6))
            record["seconds"] = round(time.monotonic() - t0, 2)
        self.results.append(record)
        self.lines.write(json.dumps(record) + "\n")
        self.lines.flush()
        print(f"[{record['status']:7s}] {name} ({record.get('seconds', 0)} s)", flush=True)

    def finish(self) -> int:
        self.lines.close()
        failed = [r["phase"] for r in self.results if r["status"] != "passed"]
        lines = ["# engine device check", "", f"device {self.device}, {len(self.results)} phases, "
                 f"{time.monotonic() - self.started:.0f} s; " + (f"NOT passed: {', '.join(failed)}" if failed
                                                                 else "all passed"), ""]
        for r in self.results:
            lines.append(f"## {r['phase']}: {r['status']}")
            lines.append("```")
            lines.append(json.dumps({k: v for k, v in r.items() if k not in ("phase", "traceback")}, indent=1))
            lines.append("```")
        (self.out / "report.md").write_text("\n".join(lines) + "\n")
        return 1 if failed else 0


# ---------------------------------------------------------------------------- phases


def env_phase(device: torch.device) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device),
            "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(cuda=torch.version.cuda, name=props.name, memory_gib=round(total / 2**30, 1),
                    free_gib=round(free / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                    capability=f"{props.major}.{props.minor}")
    else:
        info.update(onednn=torch.backends.mkldnn.is_available())
    return info


DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))


def _runner(model: Any, device: torch.device, dtype: torch.dtype, *, invariant: bool = True,
            compile: bool = False):
    """A pooled runner over `model`, calibrated and checked like a target service's
    (engine.host.pick_runner; raises engine.host.Inexact where its verify shapes are not exact)."""
    from engine.host import HostLimits, pick_runner

    return pick_runner(loaded_of(model, device, dtype), HostLimits(
        max_batch=256, batch_invariant=invariant, cache_budget_bytes=1 << 30, compile=compile,
        require_exact=invariant, max_k=8))


class Runners:
    """One model and calibrated pooled runner per dtype, shared by the phases that check them: a
    runner's calibration and self-check cost more than most phases' own work on a CPU."""

    def __init__(self, device: torch.device, layers: int | None):
        self.device, self.layers = device, layers
        self.built: dict[torch.dtype, tuple[Any, Any]] = {}

    def __call__(self, dtype: torch.dtype) -> tuple[Any, Any]:
        """(model, runner); raises engine.host.Inexact as _runner does, again on each call."""
        if dtype not in self.built:
            model = build_model(self.device, dtype, self.layers)
            self.built[dtype] = (model, _runner(model, self.device, dtype))
        return self.built[dtype]


def _logits(runner, rows) -> list[torch.Tensor]:
    from engine.plan import RowPlan, StepPlan

    plans = []
    for cache, tokens in rows:
        cache.reserve(cache.length + len(tokens))
        plans.append(RowPlan(cache, tokens, cache.length, len(tokens)))
    out = runner.logits(StepPlan(plans)).float()
    result, at = [], 0
    for plan in plans:
        result.append(out[at:at + plan.emit])
        at += plan.emit
    return result


def cached_phase(device: torch.device, layers: int | None, steps: int) -> dict:
    """Decode `steps` tokens through the pool, each step against a full recompute without cache."""
    model = build_model(device, torch.float32, layers)
    reference = build_model(device, torch.float32, layers)  # the engine takes the first one's weights
    runner = _runner(model, device, torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(5)
    seq = torch.randint(0, model.config.vocab_size, (40,), generator=gen).tolist()
    cache = runner.new_cache()
    worst, flips = 0.0, 0
    last = _logits(runner, [(cache, seq)])[0][-1]
    with torch.inference_mode():
        for _ in range(steps):
            full = reference(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, -1].float()
            worst = max(worst, float((full - last).abs().max()))
            flips += int(full.argmax() != last.argmax())
            token = int(last.argmax())
            seq.append(token)
            last = _logits(runner, [(cache, [token])])[0][-1]
    return {"steps": steps, "max_abs_logit_diff": worst, "argmax_flips": flips, "ok": flips == 0}


def selfcheck_phase(runners: Runners) -> dict:
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("engine.host")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        from engine.host import Inexact

        out = {}
        for name, dtype in DTYPES:
            records.clear()
            try:
                runner = runners(dtype)[1]
            except Inexact as exc:
                out[name] = {"runner": "refused", "reason": str(exc), "log": list(records)}
                continue
            forward = getattr(runner, "forward", None)
            out[name] = {"runner": type(runner).__name__, "log": list(records),
                         "attention_dtype": str(getattr(forward, "attention_dtype", "")).removeprefix("torch."),
                         "pads": sorted({f"{lin.in_features}->{lin.out_features}: {lin.pad_to}"
                                         for lin in getattr(forward, "linears", lambda: [])()})}
        out["ok"] = all(v["runner"] == "PooledRunner" for v in out.values() if isinstance(v, dict))
        return out
    finally:
        logger.removeHandler(handler)


def invariance_phase(runners: Runners, counts: list[int]) -> dict:
    """One probe session decoding 8 steps alone, then packed with n - 1 others, per count n."""
    out: dict[str, Any] = {}
    ok = True
    for name, dtype in DTYPES:
        model, runner = runners(dtype)
        vocab = model.config.vocab_size
        gen = torch.Generator(device="cpu").manual_seed(7)
        probe = torch.randint(0, vocab, (30,), generator=gen).tolist()
        steps = torch.randint(0, vocab, (8,), generator=gen).tolist()

        def trace(others: int) -> list[torch.Tensor]:
            caches = [runner.new_cache() for _ in range(others + 1)]
            fillers = [torch.randint(0, vocab, (int(torch.randint(5, 60, (1,), generator=gen)),),
                                     generator=gen).tolist() for _ in range(others)]
            got = [_logits(runner, [(caches[0], probe)])[0]]
            for c, f in zip(caches[1:], fillers):
                _logits(runner, [(c, f)])
            for j, t in enumerate(steps):
                mix = [(caches[0], [t])] + [(c, [int(x)]) for c, x in zip(
                    caches[1:], torch.randint(0, vocab, (others,), generator=gen))]
                if j % 3 == 2:  # every third step the probe scores 3 tokens, Score-like
                    mix[0] = (caches[0], [t, t, t])
                got.append(_logits(runner, mix)[0])
            for c in caches:
                c.free()
            return got

        with torch.inference_mode():
            alone = trace(0)
            per = {}
            for n in counts:
                packed = trace(n - 1)
                same = all(torch.equal(a, b) for a, b in zip(alone, packed))
                diff = max(float((a - b).abs().max()) for a, b in zip(alone, packed))
                flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(alone, packed))
                per[str(n)] = {"bitwise": same, "max_abs_logit_diff": diff, "argmax_flips": flips}
                ok = ok and same  # every dtype must hold
        out[name] = per
    out["ok"] = ok
    return out


def score_steps_phase(runners: Runners, sequences: int = 16) -> dict:
    """Score over k + 1 = 5 tokens in one forward vs 5 one-token steps, `sequences` sequences."""
    out: dict[str, Any] = {}
    ok = True
    for name, dtype in DTYPES:
        model, runner = runners(dtype)
        gen = torch.Generator(device="cpu").manual_seed(9)
        worst, flips, positions, bitwise = 0.0, 0, 0, True
        with torch.inference_mode():
            for _ in range(sequences):
                seq = torch.randint(0, model.config.vocab_size, (45,), generator=gen).tolist()
                a, b = runner.new_cache(), runner.new_cache()
                _logits(runner, [(a, seq[:40])])
                _logits(runner, [(b, seq[:40])])
                one = _logits(runner, [(a, seq[40:])])[0]
                steps = torch.cat([_logits(runner, [(b, [t])])[0] for t in seq[40:]])
                worst = max(worst, float((one - steps).abs().max()))
                flips += int((one.argmax(-1) != steps.argmax(-1)).sum())
                bitwise = bitwise and torch.equal(one, steps)
                positions += one.shape[0]
                a.free()
                b.free()
        out[name] = {"bitwise": bitwise, "max_abs_logit_diff": worst, "argmax_flips": flips, "positions": positions}
        ok = ok and bitwise
    out["ok"] = ok
    return out


def identity_phase(runners: Runners, counts: list[int], steps: int) -> dict:
    """Greedy speculative decoding against target-only, per dtype and count of concurrent sessions.

    Target-only: each session alone, one token per forward. Speculative: every session in one
    forward per round, drafting k = 4 tokens of its target-only continuation with each replaced by
    a random one with probability 0.3, accepting by argmax and committing the bonus token. A tree:
    per session, the next 3 target-only tokens as a path with a random sibling beside each node,
    all sessions in one forward, the path's logits against the one-at-a-time ones, bitwise.
    """
    from engine.plan import RowPlan, StepPlan
    from engine.tree import PendingTree

    out: dict[str, Any] = {}
    ok = True
    for name, dtype in DTYPES[1:]:
        model, runner = runners(dtype)
        vocab = model.config.vocab_size
        per = {}
        for n in counts:
            gen = torch.Generator(device="cpu").manual_seed(17 + n)
            prompts = [torch.randint(0, vocab, (int(torch.randint(5, 60, (1,), generator=gen)),),
                                     generator=gen).tolist() for _ in range(n)]
            with torch.inference_mode():
                reference, ref_logits = [], []
                for prompt in prompts:  # target-only, alone
                    cache = runner.new_cache()
                    logits = [_logits(runner, [(cache, prompt)])[0][-1]]
                    tokens = []
                    for _ in range(steps):
                        tokens.append(int(logits[-1].argmax()))
                        logits.append(_logits(runner, [(cache, [tokens[-1]])])[0][-1])
                    cache.free()
                    reference.append(tokens)
                    ref_logits.append(torch.stack(logits))
                caches = [runner.new_cache() for _ in prompts]
                for cache, prompt in zip(caches, prompts):
                    _logits(runner, [(cache, prompt[:-1])])
                done: list[list[int]] = [[] for _ in prompts]
                pending = [[p[-1]] for p in prompts]  # the last fed token, then the drafts
                rounds = 0
                while any(len(d) < steps for d in done):
                    live = [i for i in range(n) if len(done[i]) < steps]
                    rows = []
                    for i in live:
                        at = len(done[i])
                        drafts = [t if float(torch.rand(1, generator=gen)) > 0.3 else
                                  int(torch.randint(0, vocab, (1,), generator=gen))
                                  for t in reference[i][at:at + 4]]
                        rows.append((caches[i], pending[i] + drafts))
                    results = _logits(runner, rows)
                    rounds += 1
                    for i, (cache, fed), logits in zip(live, rows, results):
                        base = cache.length - len(fed)
                        accepted = 0
                        while accepted < len(fed) - 1 and int(logits[accepted].argmax()) == fed[accepted + 1]:
                            accepted += 1
                        commit = fed[1:accepted + 1] + [int(logits[accepted].argmax())]
                        done[i].extend(commit)
                        cache.crop(base + 1 + accepted)  # keep the fed token and the accepted drafts
                        pending[i] = [commit[-1]]
                identical = sum(d[:steps] == r for d, r in zip(done, reference))
                for cache in caches:
                    cache.free()
                # One tree Score per session, all packed: the path of first children is target-only's.
                caches = [runner.new_cache() for _ in prompts]
                for cache, prompt in zip(caches, prompts):
                    _logits(runner, [(cache, prompt)])
                plans = []
                for cache, prompt, tokens in zip(caches, prompts, reference):
                    nodes = [tokens[0], (tokens[0] + 1) % vocab, tokens[1], (tokens[1] + 7) % vocab,
                             tokens[2], (tokens[2] + 3) % vocab]
                    tree = PendingTree(len(prompt), 0).row(0, [-1, -1, 0, 0, 2, 2])
                    cache.reserve(cache.length + len(nodes))
                    plans.append(RowPlan(cache, nodes, cache.length, len(nodes), tree=tree))
                logits = runner.logits(StepPlan(plans)).float()
                tree_same = sum(torch.equal(logits[6 * j:6 * j + 6][[0, 2, 4]], ref_logits[j][1:4])
                                for j in range(n))
                for cache in caches:
                    cache.free()
            per[str(n)] = {"identical": identical, "sessions": n, "rounds": rounds,
                           "tree_path_bitwise": tree_same}
            ok = ok and identical == n and tree_same == n
        out[name] = per
    out["ok"] = ok
    return out


def timing_phase(device: torch.device, layers: int | None, reps: int, compile: bool = False) -> dict:
    """Milliseconds per forward: the engine at 1 / 4 / 16 sessions, and the model's own at 1."""
    from transformers import DynamicCache

    from engine.stock import cache_kwarg

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(device, dtype, layers)
    reference = build_model(device, dtype, layers)
    runner = _runner(model, device, dtype, compile=compile)
    gen = torch.Generator(device="cpu").manual_seed(11)
    vocab = model.config.vocab_size

    def clock(fn: Callable[[], Any]) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return round(times[len(times) // 2], 3)

    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "reps": reps}
    with torch.inference_mode():
        for sessions in (1, 4, 16):
            caches = [runner.new_cache() for _ in range(sessions)]
            for c in caches:
                _logits(runner, [(c, torch.randint(0, vocab, (200,), generator=gen).tolist())])
            for n in (1, 5):
                def step(n: int = n) -> None:
                    _logits(runner, [(c, [3] * n) for c in caches])
                    for c in caches:
                        c.crop(c.length - n)
                out[f"engine_{sessions}x{n}_ms"] = clock(step)
            for c in caches:
                c.free()
        prompt = torch.randint(0, vocab, (1, 200), generator=gen).to(device)
        cache = DynamicCache(config=reference.config)
        kw = cache_kwarg(reference)
        reference(input_ids=prompt, use_cache=True, **{kw: cache})
        one = torch.tensor([[3]], device=device)
        position = torch.tensor([[200]], device=device)

        def stock() -> None:
            reference(input_ids=one, position_ids=position, use_cache=True, logits_to_keep=1, **{kw: cache})
            cache.crop(-1)

        out["stock_1x1_ms"] = clock(stock)
    out["engine_vs_stock_1x1"] = round(out["engine_1x1_ms"] / out["stock_1x1_ms"], 3)
    return out


def oom_phase(device: torch.device, layers: int | None) -> dict:
    """Fill the GPU, then Score: out of memory -> evict idle, retry once -> RESOURCE_EXHAUSTED."""
    if device.type != "cuda":
        return {"skipped": "a CPU has no out-of-memory path to provoke safely"}
    from engine.host import HostLimits, ModelHost
    from specdec.core.fingerprint import fingerprint
    from specdec.core.sampling import SamplingParams
    from specdec.runtime.errors import ResourceExhausted
    from model_service.requests import ModelRequest
    from target_service.scoring import score

    model = build_model(device, torch.bfloat16, layers)
    host = ModelHost(loaded_of(model, device, torch.bfloat16),
                     HostLimits(max_batch=16, cache_budget_bytes=256 << 20))
    prompt = list(range(10, 250))

    def request(session: str) -> ModelRequest:
        return ModelRequest(session, 0, fingerprint([]), prompt, 0, SamplingParams(), False)

    result: dict[str, Any] = {}
    hog: list[torch.Tensor] = []
    try:
        async def main() -> None:
            await score(host, request("idle"))
            torch.cuda.empty_cache()
            for chunk in (1 << 30, 64 << 20, 1 << 20):  # take everything the allocator will give
                while True:
                    try:
                        hog.append(torch.empty(chunk, dtype=torch.uint8, device=device))
                    except torch.OutOfMemoryError:
                        break
            try:
                await score(host, request("big"))
                result["under_pressure"] = "served (the forward fit in what was left)"
            except ResourceExhausted as exc:
                result["under_pressure"] = f"RESOURCE_EXHAUSTED: {exc}"
            result["idle_session_evicted"] = "idle" not in host.caches
            hog.clear()
            torch.cuda.empty_cache()
            done = await score(host, request("after"))
            result["served_after"] = done.cache_length == len(prompt)

        asyncio.run(main())
    finally:
        hog.clear()
        host.shutdown()
    result["ok"] = bool(result.get("served_after")) and "under_pressure" in result
    return result


def top_p_phase(device: torch.device) -> dict:
    """probs_from_logits with top_p: bitwise the same on repeats; the same kept set as on the CPU."""
    from specdec.core.sampling import SamplingParams, probs_from_logits

    gen = torch.Generator(device="cpu").manual_seed(13)
    logits = (torch.randn(64, 49152, generator=gen) * 3).to(device)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    first = probs_from_logits(logits, params)
    repeats_same = all(torch.equal(first, probs_from_logits(logits, params)) for _ in range(5))
    cpu = probs_from_logits(logits.cpu(), params)
    same_support = torch.equal(first.cpu() > 0, cpu > 0)
    return {"repeats_bitwise": repeats_same, "kept_set_equals_cpu": same_support,
            "max_abs_diff_vs_cpu": float((first.cpu() - cpu).abs().max()),
            "ok": repeats_same and same_support}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.gpucheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for phases.jsonl and report.md")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--quick", action="store_true", help="2 layers and fewer rows (the CI dry run on a CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text("# engine device check\n\nno CUDA GPU: torch.cuda.is_available() is "
                                            f"False (torch {torch.__version__})\n")
        print(f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}); "
              "use --device cpu for the dry run", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)
    layers = 2 if args.quick else None
    counts = [1, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    check = Check(args.out, device, args.quick)
    runners = Runners(device, layers)
    check.phase("env", lambda: env_phase(device))
    check.phase("cached", lambda: cached_phase(device, layers, 8 if args.quick else 32))
    check.phase("selfcheck", lambda: selfcheck_phase(runners))
    check.phase("invariance", lambda: invariance_phase(runners, counts))
    check.phase("score_steps", lambda: score_steps_phase(runners, 6 if args.quick else 16))
    check.phase("identity", lambda: identity_phase(runners, [1, 8] if args.quick else [1, 8, 64],
                                                   12 if args.quick else 24))
    check.phase("timing", lambda: timing_phase(device, layers, 5 if args.quick else 30))
    if device.type == "cuda":  # compiling costs minutes on a CPU and measured slower there
        check.phase("timing_compiled", lambda: timing_phase(device, layers, 30, compile=True))
    check.phase("oom", lambda: oom_phase(device, layers))
    check.phase("top_p", lambda: top_p_phase(device))
    return check.finish()


if __name__ == "__main__":
    raise SystemExit(main())

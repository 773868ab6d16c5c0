"""Matrix products whose output for a token comes out the same whatever else is in the batch.

A GEMM library picks its kernel by the token count M (x is [M, in], one row of x per
token), and with it the rounding: token 0 of x[:1] @ W and of x[:8] @ W can differ in the last bits. On this
project's CPU (MKL + oneDNN, fp32, one thread), measured per weight shape of
SmolLM2-135M over M = 1..64:

  * `F.linear` (MKL, W stored [out, in]): three bit classes, M = 1, 2..15, >= 16;
  * `x @ W.t().contiguous()` (MKL, [in, out]): M = 1 and M >= 2;
  * oneDNN with a prepacked weight (`torch.ops.mkldnn._linear_pointwise`, the
    kernel inductor's CPU freezing pass uses): ONE class for every M, except
    the 1536-wide down projection, whose M = 1 differs from M >= 2;
  * the same in bfloat16 (Intel, AMX): M <= 32 (36 for the down projection) differ
    from larger M, and mostly only for a few tokens: bf16 output rounding hides
    most accumulation differences, so the test input has columns spread over
    four orders of magnitude to make them show;
  * bfloat16 on an AMD EPYC (AVX-512 BF16, oneDNN): as fp32 there, one class for
    every M but the down projection's M = 1 (pad 2).

So an `InvariantLinear` is a kernel plus `pad_to`: fewer tokens than that are padded
with zero tokens (never seen by anyone). `calibrate` measures, at start-up on the
serving device, dtype and thread count, per weight shape and kernel the
smallest `pad_to` for which every token count gives the same bits, and keeps the
kernel whose padded product costs least; a lone one-token decode then pays
only for the shapes that need it (SmolLM2 fp32 on this CPU: oneDNN everywhere,
one 1 -> 2 token pad per layer) instead of padding the whole forward, and a
small model's products take F.linear padded to 16 tokens, cheaper there than
oneDNN's per-call cost.

On CUDA (no oneDNN) the kernel is `F.linear` (cuBLAS); there the runner pads
the whole forward to a fixed token bucket instead (engine.runner), so the
calibration here only records what it finds.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DENSE_UP_TO = 64  # calibration tests every token count M up to this, then a sample


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the prepacked oneDNN linear serves `dtype` on `device`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        check = getattr(ops, "_is_mkldnn_bf16_supported", None)
        return bool(check is not None and check())
    return dtype == torch.float32


class InvariantLinear:
    """y = x @ W.T + b for x [M, in], with a fixed kernel and M (tokens) padded up to `pad_to`.

    `onednn` says which kernel runs: the prepacked oneDNN one, or F.linear on
    the plain weight. A linear made with onednn=True keeps both forms until
    `calibrate` has chosen one (`choose`), so the choice can follow the
    measured cost of each, padding included.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, onednn: bool):
        weight = weight.detach()
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        self.dtype, self.device = weight.dtype, weight.device
        self.bias = bias.detach() if bias is not None else None
        self.onednn = onednn
        self.source_weight: torch.Tensor | None = weight  # [out, in], shared with the model (not copied)
        self.plain = weight.contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.plain, None) if onednn else None
        self.pad_to = 1

    @property
    def kinds(self) -> list[bool]:
        """The kernels this linear can still run (True = oneDNN)."""
        return [True, False] if self.packed is not None else [False]

    def choose(self, onednn: bool, pad_to: int) -> None:
        """Keep one kernel (and free the other form of the weight)."""
        self.onednn, self.pad_to = onednn, pad_to
        if onednn:
            self.plain = None
        else:
            self.packed = None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.plain, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        m = x.shape[0]
        if m < self.pad_to:
            padded = x.new_zeros(self.pad_to, self.in_features)
            padded[:m] = x
            return self.kernel(padded)[:m]
        return self.kernel(x)

    def narrowed(self, width: int, onednn: bool) -> "InvariantLinear":
        """The same kernel over the first `width` outputs (a cheap calibration probe)."""
        bias = self.bias[:width] if self.bias is not None else None
        return InvariantLinear(self.plain[:width], bias, onednn=onednn)

    @property
    def shape(self) -> tuple[int, int, torch.dtype, bool]:
        return (self.in_features, self.out_features, self.dtype, self.bias is not None)

    def __repr__(self) -> str:
        kind = "oneDNN" if self.onednn else "F.linear"
        return f"InvariantLinear({self.in_features}->{self.out_features}, {kind}, pad_to={self.pad_to})"


def fused(linears: Sequence[torch.nn.Linear], *, onednn: bool) -> InvariantLinear:
    """One InvariantLinear computing several linears of the same input side by side (q|k|v, gate|up)."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b.detach() if b is not None else lin.weight.new_zeros(lin.out_features)
                          for b, lin in zip(biases, linears)])
    return InvariantLinear(weight, bias, onednn=onednn)


def _candidates(limit: int) -> list[int]:
    """Every token count up to DENSE_UP_TO, then a geometric-ish sample up to `limit`."""
    out = list(range(1, min(limit, DENSE_UP_TO) + 1))
    m = DENSE_UP_TO
    while m < limit:
        m = min(limit, max(m + 8, int(m * 1.5)) // 8 * 8)
        out.append(m)
    return out


SMALL = 8  # counts up to this are also tried on OFFSETS more windows of the input, not only its first rows
OFFSETS = 12


def _agreeing(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: list[int]) -> list[bool]:
    """Per count m whether its m tokens' outputs equal the same tokens' computed among counts[-1].

    A small count is tried on several windows of x, not only its first rows: which tokens differ
    depends on their values. In float16 on an Intel CPU with AVX-512 FP16, F.linear gave a token
    alone other bits than among 16 for one row in 96, never for the first: the first rows alone
    found every shape invariant, and the tiny target failed the start-up check (its decode steps
    are one token each); with 12 more windows every shape pads 1 -> 2 and the check passes."""
    reference = fn(x[:counts[-1]])

    def agree(m: int) -> bool:
        starts = range(0, min(OFFSETS, counts[-1] - m) + 1) if m <= SMALL else (0,)
        return all(torch.equal(fn(x[j:j + m]), reference[j:j + m]) for j in starts)

    return [agree(m) for m in counts]


TRIALS = 2  # inputs per shape; a class split shows for some tokens of some inputs only
PROBE_WIDTH = 4096  # wider products (the LM head) are probed on their first outputs only
LARGE = 1 << 18  # weights with this many elements take oneDNN where it is invariant, untimed


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` found: per weight shape the kernel and pad, and whether every count was covered."""

    pads: dict[tuple, int]
    kernels: dict[tuple, str]
    invariant: bool  # False: some shape has no single class up to the largest count tested

    def describe(self) -> str:
        parts = [f"{s[0]}->{s[1]}: {self.kernels[s]} pad {p}"
                 for s, p in sorted(self.pads.items(), key=lambda i: i[0][:2])]
        return ", ".join(parts) + ("" if self.invariant else " (NOT invariant for every count)")


def _pad_for(lin: InvariantLinear, onednn: bool, counts: list[int], gen: torch.Generator) -> int | None:
    """The smallest count from which every larger count gives the bits of the largest; None past DENSE_UP_TO."""
    probe = lin.narrowed(min(lin.out_features, PROBE_WIDTH), onednn)
    pad = 1
    for _ in range(TRIALS):
        spread = torch.logspace(-2, 2, lin.in_features)[torch.randperm(lin.in_features, generator=gen)]
        x = (torch.randn(counts[-1], lin.in_features, generator=gen) * spread).to(lin.device, lin.dtype)
        agree = _agreeing(probe.kernel, x, counts)
        first = next(i for i in range(len(counts)) if all(agree[i:]))
        pad = max(pad, counts[first])
    return pad if pad <= DENSE_UP_TO else None


def _cost(lin: InvariantLinear, onednn: bool, pad: int, counts: tuple[int, ...] = (1, 5), reps: int = 9) -> float:
    """Median seconds of the padded product at these token counts, summed (the full weight)."""
    trial = InvariantLinear(lin.plain, lin.bias, onednn=onednn)
    trial.pad_to = pad
    total = 0.0
    for m in counts:
        x = torch.randn(m, lin.in_features).to(lin.device, lin.dtype)
        times = []
        for _ in range(reps + 2):
            if lin.device.type == "cuda":
                torch.cuda.synchronize(lin.device)
            t0 = time.perf_counter()
            trial(x)
            if lin.device.type == "cuda":
                torch.cuda.synchronize(lin.device)
            times.append(time.perf_counter() - t0)
        total += sorted(times[2:])[reps // 2]
    return total


def calibrate(linears: Sequence[InvariantLinear], max_tokens: int) -> Calibration:
    """Per distinct weight shape: the kernel and `pad_to` that keep every token count's bits the same,
    the cheaper of them where there is a choice.

    For each kernel a linear can run, one representative of the shape is tested
    on random input over M = 1..max_tokens (dense up to DENSE_UP_TO, then sampled),
    each count against the largest, to find its pad; products wider than
    PROBE_WIDTH are probed on their first outputs (engine.selfcheck then checks
    the whole model). Among the kernels with a pad, the one whose padded
    product costs least at 1 and 5 tokens (a decode step, a Score of 4 drafts)
    is kept: oneDNN's prepacked kernel streams a large weight well but costs
    tens of microseconds per call, which dominates a small one. A shape with no
    pad for any kernel is left unpadded and the result says it is not invariant.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    chosen: dict[tuple, tuple[bool, int]] = {}
    invariant = True
    counts = _candidates(max(max_tokens, 2))
    with torch.inference_mode():
        for lin in linears:
            if lin.shape in chosen:
                continue
            options = []
            for onednn in lin.kinds:
                pad = _pad_for(lin, onednn, counts, gen)
                if pad is not None:
                    options.append((onednn, pad))
                    if onednn and lin.in_features * lin.out_features >= LARGE:
                        break  # a large weight: oneDNN's streaming wins (measured), no timing needed
            if len(options) > 1:
                options = [(_cost(lin, onednn, pad), onednn, pad) for onednn, pad in options]
            else:
                options = [(0.0, onednn, pad) for onednn, pad in options]
            if options:
                _, onednn, pad = min(options)
            else:
                invariant = False
                onednn, pad = lin.kinds[0], 1
            chosen[lin.shape] = (onednn, pad)
    for lin in linears:
        lin.choose(*chosen[lin.shape])
    return Calibration({s: p for s, (_, p) in chosen.items()},
                       {s: "oneDNN" if o else "F.linear" for s, (o, _) in chosen.items()}, invariant)

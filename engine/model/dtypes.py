"""Weight dtypes by name (--dtype, draft manifests) and what a device can run fast.

`auto` (the services' default) is the fastest dtype the device computes exactly: every dtype
served through the engine's pooled forward is proven bitwise invariant at start-up
(engine.selfcheck.verify_shapes), so the choice is speed alone: bfloat16 on GPUs and on CPUs with
native bf16 kernels (AVX-512 BF16, AMX), float32 elsewhere. A target whose bfloat16 fails that
proof (a CPU whose bf16 kernels round by the token count) is served in float32 instead
(model_service.serve.open_host).
"""
from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


AUTO = "auto"


def auto(device: str | torch.device) -> str:
    """What --dtype auto serves on `device` (see the module doc)."""
    return fast_on("bfloat16", device)


def fast_on(wanted: str, device: str | torch.device) -> str:
    """`wanted`, or the dtype to use instead where `device` has no fast kernels for it.

    bfloat16 on a CPU without native bf16 kernels is slower than float32, so it falls back.
    """
    kind = torch.device(device).type
    if wanted in ("bfloat16", "bf16"):
        if kind == "cuda":
            return wanted if torch.cuda.is_bf16_supported() else "float16"
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return wanted if kind == "cpu" and check is not None and check() else "float32"
    if wanted in ("float16", "fp16") and kind == "cpu":
        return "float32"
    return wanted

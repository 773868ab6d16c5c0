"""Weight dtypes by name (--dtype, draft manifests) and what a device can run fast."""
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

"""Fixtures shared by every test layer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores are shared by the test runner and every process it starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The suite's reference dtype: the services default to --dtype auto (bfloat16 on a CPU with native
# bf16), so every service a test starts without --dtype is pinned to float32 here, as the in-process
# loader's default is; tests/unit/test_dtypes.py and tests/integration/test_dtypes.py serve bfloat16
# and float16 on purpose.
os.environ.setdefault("SPECDEC_DTYPE", "float32")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): tiny random models sharing one tokenizer.

    The draft is the target plus noise, so it agrees often but not always.
    """
    import torch

    torch.set_num_threads(1)
    from tests.tiny import build_pair

    return build_pair(tmp_path_factory.mktemp("tiny"))

"""specdec.runtime.launch.split_threads: the cores are shared between target and draft, never all to each."""
from __future__ import annotations

from specdec.runtime.launch import available_cores, split_threads


def test_split_threads() -> None:
    assert (split_threads(1).target, split_threads(1).draft) == (1, 1)
    assert (split_threads(2).target, split_threads(2).draft) == (1, 1)
    assert (split_threads(3).target, split_threads(3).draft) == (2, 1)
    assert (split_threads(8).target, split_threads(8).draft) == (4, 4)
    for cores in range(2, 65):
        s = split_threads(cores)
        assert s.target + s.draft == cores and s.target >= s.draft >= 1 and s.orchestrator == 1
    assert available_cores() >= 1
    assert "2 cores: target 1 threads, draft 1, orchestrator 1" == split_threads(2).describe(2)

"""specdec.heap: a server's start-up heap frozen, the young generation widened."""
from __future__ import annotations

import gc

from specdec import heap


def test_settle_freezes_what_exists_and_widens_the_young_generation():
    before = gc.get_threshold()
    try:
        kept = [[i] for i in range(1000)]  # tracked containers that outlive the settle
        frozen = heap.settle(gen0=12_345)
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold() == (12_345, before[1], before[2])
        assert gc.isenabled()  # cycles made while serving are still collected

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2  # a cycle made after the freeze is found
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

"""specdec.runtime.heap: a server's start-up heap frozen, the young generation widened."""
from __future__ import annotations

import gc

from specdec.runtime import heap


def test_settle_freezes_what_exists_and_widens_the_young_generation():
    before = gc.get_threshold()
    try:
        kept = [[i] for i in range(1000)]  # tracked containers that outlive the settle
        frozen = heap.settle(gen0=12_345)
        # Frozen objects leave the permanent generation only by dying, and another thread's
        # garbage may die between the settle and the count (CI once saw 779,020 then 779,018).
        assert len(kept) <= gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}  # generations 0-2: the frozen ones are not there
        assert id(kept[0]) not in tracked and id(kept[-1]) not in tracked
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

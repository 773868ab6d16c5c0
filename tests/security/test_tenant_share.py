"""One tenant cannot take the fleet from the others (--tenant-share): real processes, real tokens.

Alice opens twice the target's slots at once and reads none past its first chunk; with
--tenant-share 0.5 her streams past half the slots are refused at once (target_share), and bob is
admitted. Without the share bob was refused with target_capacity
(`python -m benchmarks.faults.tenant_flood`: 64 of 64 slots alice's). The admission rule itself,
with its one-tenant control: tests/unit/test_gray.py.
"""
from __future__ import annotations

from benchmarks.faults.tenant_flood import run


def test_a_tenant_holding_every_stream_it_can_leaves_room_for_another() -> None:
    result = run(streams=16, shares=[0.5], capacity=8)["0.5"]
    alice = result["alice"]
    assert set(alice) == {"admitted", "target_share"}, alice  # refused for her share, nothing else
    assert alice["admitted"] >= 4, alice
    assert result["bob"] == "admitted", result

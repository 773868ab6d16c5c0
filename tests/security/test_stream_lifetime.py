"""A stream cannot run forever: past --max-stream-seconds it ends with DEADLINE_EXCEEDED, naming
the limit, and its target slot goes to the next stream (real processes)."""
from __future__ import annotations

import grpc
import pytest

from client import build_request
from specdec.v1 import orchestrator_pb2_grpc
from tests.integration.stack import Stack

PROMPT = "one two three four five six seven eight"


@pytest.fixture(scope="module")
def limited(tiny_pair, tmp_path_factory):
    """One target with a single slot, an orchestrator that ends streams after 0.05 s."""
    target_dir, _ = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("lifetime"))
    try:
        s.start_service("target", "target", target_dir, register=False)
        s.start_orchestrator("orch", target_dir, targets=[s.addresses["target"]],
                             extra=("--max-stream-seconds", "0.05", "--target-capacity", "1",
                                    "--default-proposer", "none"))
        with grpc.insecure_channel(s.addresses["orch"]) as channel:
            yield orchestrator_pb2_grpc.OrchestratorStub(channel)
    finally:
        s.stop()


def test_a_stream_past_its_time_ends_and_frees_its_slot(limited) -> None:
    # 400 tokens one target pass each (no proposer): far more than 0.05 s on any machine.
    for _ in range(2):  # the second is admitted: the first's slot was freed (capacity 1)
        got = []
        with pytest.raises(grpc.RpcError) as err:
            for response in limited.Generate(build_request(PROMPT, max_new_tokens=400, ignore_eos=True),
                                             timeout=60):
                got.extend(response.chunk.token_ids)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert err.value.details().startswith("max_stream_seconds:"), err.value.details()
        assert len(got) < 400

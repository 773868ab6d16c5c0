"""Proposers by name (real services, real Redis): suffix decoding learning across requests, the
registry's list on the wire, and a third-party proposer installed as a package (an entry point in
`specdec.proposers`) served to the client library and to the `openai` client through a gateway
that has never heard of it."""
from __future__ import annotations

import textwrap

import grpc
import pytest

from client import Client
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from tests.integration.stack import Stack

N_NEW = 40
PROMPT = "Extract the fields as JSON: name Ada Lovelace, born 1815, field mathematics."


def test_suffix_decoding_keeps_target_onlys_text_and_learns_from_the_last_request(client) -> None:
    want = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="none", ignore_eos=True)
    first = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="suffix", ignore_eos=True)
    second = client.complete(PROMPT, max_new_tokens=N_NEW, proposer="suffix", ignore_eos=True)
    assert first.token_ids == second.token_ids == want.token_ids
    assert first.stats.proposer == second.stats.proposer == "suffix"
    # The first request's turn is in the cache: the second continues it in long proposals.
    assert second.stats.target_passes * 2 <= first.stats.target_passes, (
        second.stats.target_passes, first.stats.target_passes)
    assert max(second.stats.drafted_per_round) > 5  # its own length, past the default k
    seeded = dict(max_new_tokens=N_NEW, temperature=0.8, seed=11, ignore_eos=True)
    assert (client.complete(PROMPT, proposer="suffix", **seeded).token_ids
            == client.complete(PROMPT, proposer="none", **seeded).token_ids)


def test_served_model_lists_the_proposers_and_an_unknown_name_is_invalid_argument(stack, client) -> None:
    with grpc.insecure_channel(stack.addresses["orch"]) as channel:
        served = orchestrator_pb2_grpc.OrchestratorStub(channel).GetServedModel(pb.GetServedModelRequest(),
                                                                                 timeout=10)
    assert served.proposers[0] == "combined"  # the default first
    assert {"draft", "lookup", "suffix", "guess", "none"} <= set(served.proposers)
    assert "prediction" not in served.proposers  # named by GenerateRequest.prediction instead
    with pytest.raises(grpc.RpcError) as err:
        client.complete(PROMPT, max_new_tokens=4, proposer="no-such-kind")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("proposer_name: unknown proposer 'no-such-kind'")
    assert "suffix" in err.value.details()


PLUGIN = '''
from orchestrator.proposers.base import Proposal, Proposer
from orchestrator.proposers.registry import ProposerKind


class EchoProposer(Proposer):
    """Guesses that the last token repeats, k times."""

    name = "echo"

    async def propose(self, ctx):
        return Proposal(tokens=[ctx.tokens[-1]] * ctx.k)


class EchoHome:
    def __init__(self, config):
        self.opened = 0

    async def open(self, opening):
        self.opened += 1
        return EchoProposer()


KIND = ProposerKind("echo", "the last token, k times", EchoHome)
'''


@pytest.fixture(scope="module")
def plugged(tiny_pair, tmp_path_factory):
    """A target and an orchestrator whose Python has the `echo-plugin` package installed (a module
    and its dist-info with the entry point, on PYTHONPATH); a gateway without it."""
    site = tmp_path_factory.mktemp("site")
    (site / "echo_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "echo_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specdec.proposers]\necho = echo_plugin:KIND\n")
    target_dir, _ = tiny_pair
    s = Stack(logs=tmp_path_factory.mktemp("plugged"))
    try:
        t = s.start_service("target", "target", target_dir, register=False)
        s.start_orchestrator("orch", target_dir, targets=[t], env={"PYTHONPATH": str(site)})
        s.gateway = s.start_gateway()
        yield s
    finally:
        s.stop()


def test_an_installed_plugin_is_served_by_name_through_the_client_and_the_gateway(plugged) -> None:
    openai = pytest.importorskip("openai")
    prompt = "one one one one one one one one"
    with Client(plugged.addresses["orch"], timeout=120) as c:
        want = c.complete(prompt, max_new_tokens=24, proposer="none", ignore_eos=True)
        out = c.complete(prompt, max_new_tokens=24, proposer="echo", k=3, ignore_eos=True, round_tokens=True)
        assert "echo" in c.served_model().proposers
    assert out.token_ids == want.token_ids
    assert out.stats.proposer == "echo" and out.stats.drafted_tokens > 0
    assert {r.source for r in out.stats.rounds if r.drafted} == {"echo"}
    api = openai.OpenAI(base_url=f"{plugged.gateway}/v1", api_key="unused")
    done = api.completions.create(model="specdec", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"speculation": {"proposer": "echo", "k": 3}, "ignore_eos": True})
    assert done.usage.model_extra["speculation"]["proposer"] == "echo"
    assert done.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="specdec", prompt=prompt, max_tokens=4,
                               extra_body={"speculation": {"proposer": "no-such-kind"}})
    assert err.value.body["param"] == "speculation.proposer"

"""The playground's HTTP API and the orchestrator's Predict, against the real stack.

Predict is held to the model itself: the tiny target loaded in-process through transformers
must give the same top tokens and probabilities at every position, and the draft the same q."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from gateway.playground import STATIC
from tests.chance import FALSE_ALARM
from tests.integration.stack import post_json
from tests.playground.conftest import BIG_QUOTA, start_gateway

TEXT = "The cat sat on the mat and the dog sat on the log."


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    return post_json(f"{base}/playground/api{path}", body, timeout=120)


def events(base: str, body: dict) -> list[tuple[str, dict]]:
    """The SSE events of one /generate call."""
    request = urllib.request.Request(f"{base}/playground/api/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    out = []
    for block in re.split(r"\r?\n\r?\n", raw):
        name = re.search(r"^event: (\S+)", block, re.M)
        data = re.search(r"^data: (.*)$", block, re.M)
        if name and data:
            out.append((name.group(1), json.loads(data.group(1))))
    return out


@pytest.fixture(scope="module")
def models(pg):
    from transformers import AutoModelForCausalLM

    return (AutoModelForCausalLM.from_pretrained(pg.target_dir, dtype=torch.float32).eval(),
            AutoModelForCausalLM.from_pretrained(pg.draft_dir, dtype=torch.float32).eval())


def _softmax(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.softmax(logits / temperature, dim=-1)


def test_predict_is_the_models_own_softmax_at_every_position(pg, grpc_client, tokenizer, models):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    reply = grpc_client.predict(TEXT, top_k=3)
    assert [t.id for t in reply.tokens] == ids and reply.target_passes == 1
    probs = _softmax(models[0], ids)  # row i: after ids[:i + 1]
    assert not reply.tokens[0].predicted
    for i, token in enumerate(reply.tokens[1:], start=1):
        top = torch.topk(probs[i - 1], 3)
        assert [c.id for c in token.predicted] == top.indices.tolist()
        assert [c.prob for c in token.predicted] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert token.prob == pytest.approx(float(probs[i - 1, token.id]), abs=1e-4)
    assert [c.id for c in reply.next] == torch.topk(probs[-1], 3).indices.tolist()
    # The HTTP form is the same reply.
    status, body = post(pg.base, "/predict", {"text": TEXT, "top_k": 3})
    assert status == 200 and body["passes"] == 1
    assert [t["id"] for t in body["tokens"]] == ids
    assert [[c["id"] for c in t["predicted"]] for t in body["tokens"]] == \
        [[c.id for c in t.predicted] for t in reply.tokens]


def test_predict_distributions_are_p_and_q(grpc_client, tokenizer, models):
    from specdec.runtime.wire import decode_probs

    prompt = "The cat sat on the"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply = grpc_client.predict(prompt, temperature=0.8, distributions=True)
    assert (reply.target_passes, reply.draft_calls) == (1, 1)
    p = decode_probs(reply.target_next)[0]
    q = decode_probs(reply.draft_next)[0]
    assert torch.allclose(p, _softmax(models[0], ids, 0.8)[-1], atol=1e-5)
    assert torch.allclose(q, _softmax(models[1], ids, 0.8)[-1], atol=1e-5)
    assert not torch.allclose(p, q, atol=1e-3)  # two models: the panel has something to test


def test_predict_errors_name_the_field(grpc_client):
    from specdec.v1 import orchestrator_pb2 as pb

    stub = grpc_client._stub
    for request, field in [(pb.PredictRequest(text=""), "text"),
                           (pb.PredictRequest(text="x", top_k=50), "top_k"),
                           (pb.PredictRequest(text="x", sampling={"temperature": 0.0}), "temperature")]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
def test_generate_streams_every_round_and_a_repeat_is_free(pg, grpc_client, proposer):
    prompt = TEXT + " The cat"
    ref = grpc_client.complete(prompt, max_new_tokens=14, temperature=0.0, proposer=proposer, k=3)
    none = grpc_client.complete(prompt, max_new_tokens=14, temperature=0.0, proposer="none")
    assert ref.token_ids == none.token_ids
    body = {"prompt": prompt, "proposer": proposer, "k": 3, "max_new_tokens": 14}
    got = events(pg.base, body)
    rounds = [e for name, e in got if name == "round"]
    (done,) = [e for name, e in got if name == "done"]
    assert [t["id"] for r in rounds for t in r["committed"]] == list(ref.token_ids)
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    assert done["stats"]["target_passes"] == len(rounds) == ref.stats.target_passes
    assert done["token_ids"] == list(ref.token_ids) and done["text"] == ref.text
    assert done["charged"] == len(rounds) and not done["cached"]
    for r in rounds:
        assert r["source"] in ("", proposer)
        drafted = [t["id"] for t in r["drafted"]]
        committed = [t["id"] for t in r["committed"]]
        assert committed[: r["accepted"]] == drafted[: r["accepted"]]
        assert r["extra_kind"] == ("bonus" if r["accepted"] == len(drafted) else "recovered")
    before = done["quota"]["remaining"]
    again = events(pg.base, body)
    assert [e for n, e in again if n == "round"] == rounds
    (replay,) = [e for n, e in again if n == "done"]
    assert replay["cached"] and replay["charged"] == 0
    assert replay["quota"]["remaining"] == before  # a repeat costs nothing


def test_check_endpoint_commits_the_accepted_guess_and_the_targets_token(pg, grpc_client):
    prompt, guess = "The cat sat on the", " mat and the"
    ref = grpc_client.check(prompt, guess)
    status, body = post(pg.base, "/check", {"prompt": prompt, "guess": guess})
    assert status == 200 and body["passes"] == 1
    assert body["accepted"] == ref.accepted and body["first_mismatch"] == ref.first_mismatch
    extra = ref.positions[ref.first_mismatch].predicted_id if ref.first_mismatch >= 0 else ref.next_id
    assert [t["id"] for t in body["committed"]] == \
        [p.guess_id for p in ref.positions[: ref.accepted]] + [extra]


def test_sample_endpoint_exact_and_control(pg):
    """Seed 2 is fixed: given the code the outcome is deterministic. For a fresh seed the exact
    sampler fails its check with probability 1e-6 (tests.chance.FALSE_ALARM); the control's
    statistic (printed) is 524 against a critical value of 65 (20 degrees of freedom): it is
    caught at any seed."""
    body = {"prompt": "The dog sat on the", "draws": 3000, "seed": 2}
    status, exact = post(pg.base, "/sample", body)
    assert status == 200 and exact["p_value"] > FALSE_ALARM, exact
    assert sum(b["count"] for b in exact["bins"]) == 3000
    assert exact["charged"] == 1 and exact["target_only_passes"] == 3000
    status, wrong = post(pg.base, "/sample", {**body, "sampler": "wrong"})
    print(f"\nsample panel: exact chi-square {exact['chi_square']:.1f} (p={exact['p_value']:.3f}), wrong "
          f"{wrong['chi_square']:.1f} on {wrong['dof']} degrees of freedom (p={wrong['p_value']:.2e})")
    assert status == 200 and wrong["p_value"] < FALSE_ALARM, wrong
    assert wrong["charged"] == 0 and wrong["cached"]  # the same p and q: no new pass


def test_bad_requests_are_400_naming_the_field(pg):
    for path, body, field in [
        ("/generate", {"prompt": "x", "proposer": "magic"}, "proposer"),
        ("/generate", {"prompt": "x", "max_new_tokens": 1000}, "max_new_tokens"),
        ("/generate", {"prompt": "x", "proposer": "guess"}, "guess"),
        ("/generate", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/predict", {"text": ""}, "text"),
        ("/check", {"prompt": "x"}, "guess"),
        ("/sample", {"prompt": "x", "sampler": "sloppy"}, "sampler"),
    ]:
        status, reply = post(pg.base, path, body)
        assert status == 400, (path, body, reply)
        assert reply["error"]["param"] == field, reply
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{pg.base}/playground/api/speedup?alpha=2", timeout=10)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == "alpha"
    # The orchestrator's own refusals keep their status and name the field: a prompt longer
    # than the tiny target's context (512) is OUT_OF_RANGE.
    status, reply = post(pg.base, "/generate", {"prompt": "a b " * 900, "max_new_tokens": 2})
    assert (status, reply["error"]["param"], reply["error"]["code"]) == (400, "prompt", "out_of_range")


def test_page_assets_are_local_and_the_flag_turns_it_off(pg):
    html = urllib.request.urlopen(f"{pg.base}/playground", timeout=10).read().decode()
    assert "/playground/static/app.js" in html
    for asset in STATIC.iterdir():
        text = asset.read_text()
        urls = set(re.findall(r"https?://[^\s\"'<>)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{asset.name} refers to {urls}"
        served = urllib.request.urlopen(f"{pg.base}/playground/static/{asset.name}", timeout=10)
        assert served.read().decode() == text
    assert sum(a.stat().st_size for a in STATIC.iterdir()) < 64_000  # kept small
    off = start_gateway(pg.stack, "gateway-off", "--no-playground")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{off}/playground", timeout=10)
    assert err.value.code == 404
    assert urllib.request.urlopen(f"{off}/v1/models", timeout=10).status == 200
    pg.stack.stop_one("gateway-off")
    assert BIG_QUOTA > 1000

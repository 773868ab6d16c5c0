"""EAGLE-3 heads written by vLLM's `speculators` (0.9.0, its own Eagle3DraftModel and
save_pretrained, run in a subprocess: tests/speculators_reference.py) load as they are and draft
what `speculators`' own forward computes, logit for logit.

Its format: config.json nests the decoder layer's config (`transformer_layer_config`, a Llama or a
Qwen3 layer), the aux ids are top-level (layers entered), the weights name the layer `layers.0.*`
and carry the embedding. Its forward pairs token t + 1 with the target's feature at t and never
feeds position 0; the draft service feeds token 0 with a zero feature, which the engine keeps out of
every later position's attention. The controls: with position 0 read, or `norm_before_residual`
ignored, or the fc input's norms (`norm_before_fc`, `fc_norm`) left out, the logits differ, so the
comparison can fail. A head in EAGLE's layout put through
`speculators`' own converter loads to the same parameters as the head it came from.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.model.llama import LlamaForward
from engine.plan import RowPlan, StepPlan
from engine.runner import PooledRunner

from tests.speculators_reference import written

VARIANTS = {"llama": ("--layer-type", "llama"),
            "qwen3-norm-before-residual": ("--layer-type", "qwen3", "--norm-before-residual"),
            "llama-norm-before-fc": ("--layer-type", "llama", "--norm-before-fc"),
            "llama-fc-norm": ("--layer-type", "llama", "--fc-norm")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def head(request, tiny_pair, tmp_path_factory):
    from engine.model.loader import load

    torch.set_num_threads(1)
    folder = written(tiny_pair[0], tmp_path_factory.mktemp("speculators") / request.param, *VARIANTS[request.param])
    return request.param, folder, load(str(folder), base=str(tiny_pair[0]), dtype="float32")


def _drafted(loaded, reference: dict, forward: LlamaForward | None = None) -> torch.Tensor:
    """The engine's logits at x_1..x_n as the draft service feeds a head: token 0 with a zero feature,
    then x_t with the target's feature at t - 1; over the head's draft vocabulary."""
    forward = forward or LlamaForward(loaded.model)
    runner = PooledRunner(forward, forward.new_pool(8 << 20), fixed_shapes=False, max_rows=4)
    ids, feats = reference["input_ids"].tolist(), reference["features"]
    tokens = [7] + ids
    features = torch.cat([torch.zeros(1, feats.shape[1]), feats])
    cache = runner.new_cache()
    cache.reserve(len(tokens))
    with torch.inference_mode():
        logits = runner.logits(StepPlan([RowPlan(cache, tokens, 0, len(tokens), features=features)]))
    cache.free()
    draft_ids = torch.arange(reference["d2t"].numel()) + reference["d2t"]
    return logits[1:, draft_ids]


def test_the_format_is_speculators_own(head):
    variant, folder, loaded = head
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "transformer_layer_config" in config
    assert config["transformer_layer_config"]["model_type"] == variant.split("-")[0]
    assert loaded.feature_kind == "layers:0,1" and loaded.feature_dim == 2 * loaded.model.config.hidden_size
    attn = loaded.model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") == variant.startswith("qwen3")


def test_the_engine_drafts_what_speculators_computes(head):
    _, folder, loaded = head
    reference = torch.load(folder / "reference.pt")
    ours = _drafted(loaded, reference)
    torch.testing.assert_close(ours, reference["logits"], atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), reference["logits"].argmax(-1))


def test_the_controls_differ(head):
    variant, folder, loaded = head
    reference = torch.load(folder / "reference.pt")
    reads_position_0 = LlamaForward(loaded.model)
    reads_position_0.skip_first_key = False
    assert (_drafted(loaded, reference, reads_position_0) - reference["logits"]).abs().max() > 1e-2
    if "norm-before-residual" in variant:
        plain = LlamaForward(loaded.model)
        plain.norm_before_residual = False
        assert (_drafted(loaded, reference, plain) - reference["logits"]).abs().max() > 1e-2
    if "fc" in variant:  # the fc input's norms left out
        inner = loaded.model.model
        kept = {n: getattr(inner, n) for n in ("eagle3_input_norm", "eagle3_fc_norms") if hasattr(inner, n)}
        assert kept
        try:
            for name in kept:
                delattr(inner, name)
            assert (_drafted(loaded, reference) - reference["logits"]).abs().max() > 1e-2
        finally:
            for name, module in kept.items():
                setattr(inner, name, module)


def test_speculators_converter_output_loads_as_the_head_it_came_from(tmp_path):
    """The converter's model reads three target layers: a 3-layer tiny target here."""
    from engine.model.loader import load
    from tests.tiny import build_eagle3_head, build_model

    target = build_model(tmp_path / "target", layers=3)
    original = build_eagle3_head(target, tmp_path / "eagle", layers=(0, 1, 2))
    converted = written(target, tmp_path / "converted", "--convert", str(original), "--aux", "0,1,2")
    assert json.loads((converted / "config.json").read_text())["speculators_model_type"] == "eagle3"
    a, b = (load(str(f), base=str(target), dtype="float32") for f in (original, converted))
    assert a.feature_kind == b.feature_kind == "layers:0,1,2"
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert torch.equal(a.model.lm_head.subset, b.model.lm_head.subset)

"""EAGLE-3 heads' pieces alone: the layers a target hands back in one shared forward, the kind
string on the wire, the aux-layer default, and the orchestrator's pairing check."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.model.llama import LlamaForward
from engine.plan import LAST, RowPlan, StepPlan
from engine.runner import PooledRunner, hidden_layers
from specdec.runtime.wire import layers_feature_kind, parse_feature_kind


@pytest.fixture(scope="module")
def runner(tiny_pair):
    from engine.model.loader import load

    torch.set_num_threads(1)
    forward = LlamaForward(load(str(tiny_pair[0])).model)
    return PooledRunner(forward, forward.new_pool(16 << 20), fixed_shapes=False, max_rows=8)


def _hidden(runner, rows: list[tuple[list[int], tuple[int, ...]]]) -> list[torch.Tensor]:
    caches = [runner.new_cache() for _ in rows]
    plan = StepPlan([RowPlan(cache, tokens, 0, 1, hidden=layers) for cache, (tokens, layers) in zip(caches, rows)])
    for row in plan.rows:
        row.cache.reserve(len(row.tokens))
    outs = runner.run(plan)
    for cache in caches:
        cache.free()
    return [out.hidden for out in outs]


def test_rows_asking_for_other_layers_share_a_forward_and_get_their_own(runner, tiny_pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    a, b, c = [5, 9, 33, 7, 2], [11, 4, 8], [100, 3, 3, 60]
    mixed = _hidden(runner, [(a, LAST), (b, (1, 0)), (c, (1,))])
    alone = [_hidden(runner, [(a, LAST)])[0], _hidden(runner, [(b, (1, 0))])[0], _hidden(runner, [(c, (1,))])[0]]
    for got, want in zip(mixed, alone):
        assert torch.allclose(got, want, atol=1e-4)
    h = model.config.hidden_size
    assert [t.shape[1] for t in mixed] == [h, 2 * h, h]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([b]), output_hidden_states=True).hidden_states
    assert torch.allclose(mixed[1][:, :h], ref[1][0], atol=1e-3) and torch.allclose(mixed[1][:, h:], ref[0][0], atol=1e-3)
    assert hidden_layers(StepPlan([RowPlan(None, [1], 0, 1, hidden=(1, 0)), RowPlan(None, [1], 0, 1)])) == (1, 0)
    assert hidden_layers(StepPlan([RowPlan(None, [1], 0, 1, hidden=(1, 0)),
                                   RowPlan(None, [1], 0, 1, hidden=LAST)])) == (-1, 0, 1)


def test_the_kind_string_round_trips_and_defaults():
    from engine.model.eagle3 import aux_layers

    assert parse_feature_kind(layers_feature_kind((2, 15, 27))) == (2, 15, 27)
    assert parse_feature_kind("last-normed") == () and parse_feature_kind("") == ()
    with pytest.raises(ValueError, match="layer ids"):
        parse_feature_kind("layers:a,b")
    assert aux_layers({}, 30) == (2, 15, 27)  # EAGLE-3's own choice for an L-layer target
    # EAGLE's / vLLM's top-level key names the layers entered; SpecForge's nested one the layers'
    # outputs (SGLang adds 1): SpecForge's default [1, L/2 - 1, L - 4] is EAGLE-3's (2, L/2, L - 3).
    assert aux_layers({"eagle_aux_hidden_state_layer_ids": [1, 4, 9]}, 30) == (1, 4, 9)
    assert aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}, 30) == (2, 15, 27)
    both = {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}
    assert aux_layers(both, 30) == (2, 15, 27)
    with pytest.raises(ValueError, match="disagree"):
        aux_layers({**both, "eagle_aux_hidden_state_layer_ids": [1, 14, 26]}, 30)
    with pytest.raises(ValueError, match="aux layers"):
        aux_layers({"eagle_aux_hidden_state_layer_ids": [1, 30]}, 30)


def test_what_specdec_writes_every_reader_takes_as_the_same_layers():
    """vLLM reads the top-level ids as they are; SGLang the nested ones plus 1; specdec either."""
    from engine.model.eagle3 import aux_layer_fields, aux_layers

    for layers in ((2, 15, 27), (1, 5, 9), (0, 2)):
        fields = aux_layer_fields(layers)
        vllm = tuple(fields["eagle_aux_hidden_state_layer_ids"])
        assert vllm == layers and aux_layers(fields, 30) == layers
        if "eagle_config" in fields:
            assert tuple(i + 1 for i in fields["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == layers
        else:  # layer 0's input (the embeddings) has no output-of-layer id
            assert 0 in layers


def _info(**kw):
    base = dict(model_name="m", tokenizer_fingerprint="fp", vocab_size=384, feature_dim=0, feature_kind="",
                num_layers=2)
    return SimpleNamespace(**{**base, **kw})


def test_the_orchestrator_pairs_a_head_only_with_a_target_that_has_its_layers():
    from orchestrator.__main__ import StartupError, _pair_draft

    target = _info(model_name="t", feature_dim=64, feature_kind="last-normed")
    assert _pair_draft(_info(feature_dim=128, feature_kind="layers:0,1"), target, None) is None
    with pytest.raises(StartupError, match="no layer 2"):
        _pair_draft(_info(feature_dim=128, feature_kind="layers:0,2"), target, None)
    with pytest.raises(StartupError, match="returns 128-wide"):
        _pair_draft(_info(feature_dim=192, feature_kind="layers:0,1"), target, None)
    with pytest.raises(StartupError, match="returns none"):
        _pair_draft(_info(feature_dim=128, feature_kind="layers:0,1"), _info(num_layers=2), None)


def test_a_published_head_is_served_in_its_own_dtype_where_the_device_has_it(tmp_path, tiny_pair):
    """config.json's torch_dtype decides, as a distilled draft's manifest does (a bfloat16 head served in
    float32 streams twice the bytes per draft step); float16 on a CPU and no dtype at all serve float32."""
    import json

    from engine.model import eagle3
    from engine.model.dtypes import DTYPES, fast_on
    from engine.model.loader import load
    from tests.tiny import build_eagle3_head

    folder = build_eagle3_head(tiny_pair[0], tmp_path / "head")
    written = json.loads((folder / "config.json").read_text())
    for stored, want in (("bfloat16", fast_on("bfloat16", "cpu")), ("torch.bfloat16", fast_on("bfloat16", "cpu")),
                         ("float16", "float32"), (None, "float32"), ("int8", "float32")):
        config = {k: v for k, v in written.items() if k != "torch_dtype"}
        if stored:
            config["torch_dtype"] = stored
        (folder / "config.json").write_text(json.dumps(config))
        assert eagle3.serving_dtype(folder, "cpu") == want, stored
        if stored in ("bfloat16", None):  # and the loader serves it so when no --dtype is given
            served = load(str(folder), base=str(tiny_pair[0]), dtype=None)
            assert next(served.model.parameters()).dtype == DTYPES[want]


def test_a_sharded_head_loads_as_its_single_file_twin_and_unsupported_flags_are_refused(tmp_path, tiny_pair):
    """model.safetensors.index.json and its shards give the same head, parameter for parameter;
    a head that turns on a forward flag the engine does not compute is refused in one line."""
    import json

    from safetensors.torch import load_file, save_file

    from engine.model.loader import load
    from tests.tiny import build_eagle3_head

    whole = build_eagle3_head(tiny_pair[0], tmp_path / "whole")
    sharded = build_eagle3_head(tiny_pair[0], tmp_path / "sharded")
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    a, b = (load(str(f), base=str(tiny_pair[0]), dtype="float32").model for f in (whole, sharded))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    config = json.loads((whole / "config.json").read_text())
    for flag in ("norm_output",):
        (whole / "config.json").write_text(json.dumps({**config, flag: True}))
        with pytest.raises(ValueError, match=f"{flag}: true is not supported"):
            load(str(whole), base=str(tiny_pair[0]), dtype="float32")


def test_a_head_without_lm_head_drafts_with_the_targets_rows(tmp_path, tiny_pair):
    """As vLLM and SGLang do: no lm_head.weight in the head means the target's lm_head rows for the
    draft vocabulary; the same head with those rows written out loads to the same parameters."""
    from safetensors.torch import load_file, save_file

    from engine.model.loader import _output_embedding, load
    from tests.tiny import build_eagle3_head

    headless = build_eagle3_head(tiny_pair[0], tmp_path / "headless")
    explicit = build_eagle3_head(tiny_pair[0], tmp_path / "explicit")
    tensors = load_file(str(headless / "model.safetensors"))
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
    target_rows = _output_embedding(tiny_pair[0], torch.float32)[ids]
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(headless / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": target_rows.contiguous()}, str(explicit / "model.safetensors"))
    a, b = (load(str(f), base=str(tiny_pair[0]), dtype="float32").model for f in (headless, explicit))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert torch.equal(a.lm_head.sub_weight, target_rows)

"""A published-layout EAGLE-3 head on real processes (tiny models): the target returns the layers
it reads, the draft service loads the folder unchanged and drafts as the published computation.

The reference here is written from the layout alone (the safetensors tensors, transformers' rotary
helper and torch's attention), not through specdec's loader or forward, so a misread tensor
(the d2t offsets, the residual, hidden_norm, the order of [embedding; feature]) fails it.
"""
from __future__ import annotations

import grpc
import pytest
import torch

from specdec.v1 import common_pb2
from specdec.runtime.wire import decode_features, encode_features
from tests.service.conftest import LIMITS, propose, score

PROMPT = "The quick brown fox jumps over the lazy dog while the cat"
F32 = common_pb2.FEATURE_ENCODING_FLOAT32
LAYERS = (0, 1)  # of the 2-layer tiny target


@pytest.fixture(scope="module")
def head(services, tiny_pair, tmp_path_factory):
    from tests.tiny import build_eagle3_head

    torch.set_num_threads(1)
    folder = build_eagle3_head(tiny_pair[0], tmp_path_factory.mktemp("eagle3") / "head", layers=LAYERS)
    svc = services("draft", folder, "--base-model", str(tiny_pair[0]), *LIMITS, "--max-k", "8")
    return svc, folder


@pytest.fixture(scope="module")
def target_model(tiny_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()


def _layer_streams(model, ids: list[int]) -> torch.Tensor:
    """The residual stream entering each of LAYERS, side by side ([T, len(LAYERS) x H]): transformers'
    hidden_states[i] is what enters layer i (for i below the layer count)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)


class PublishedHead:
    """The published EAGLE-3 computation over the folder's tensors and the target's embedding."""

    def __init__(self, folder, target_model):
        import json

        from safetensors.torch import load_file

        self.w = load_file(str(folder / "model.safetensors"))
        self.config = json.loads((folder / "config.json").read_text())
        self.embed = target_model.get_input_embeddings().weight.detach()
        self.rotary = target_model.model.rotary_emb
        ids = torch.arange(self.w["d2t"].numel()) + self.w["d2t"]
        self.ids, self.vocab = ids, self.embed.shape[0]

    def _norm(self, x, name):
        eps = self.config["rms_norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w[name]

    def run(self, tokens: list[int], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T], g [T, H] (fused features) -> (full-vocabulary logits [T, V], pre-norm out [T, H])."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, c = self.w, self.config
        heads, kv, hidden = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
        hd, t = hidden // heads, len(tokens)
        x = torch.cat([self._norm(self.embed[tokens], "midlayer.input_layernorm.weight"),
                       self._norm(g, "midlayer.hidden_norm.weight")], dim=-1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(1, t, heads, hd).transpose(1, 2)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(1, t, kv, hd).transpose(1, 2)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(1, t, kv, hd).transpose(1, 2)
        cos, sin = self.rotary(x[None], torch.arange(t)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = g + o.transpose(1, 2).reshape(t, heads * hd) @ w["midlayer.self_attn.o_proj.weight"].T
        m = self._norm(h, "midlayer.post_attention_layernorm.weight")
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        logits = torch.full((t, self.vocab), float("-inf"))
        logits[:, self.ids] = self._norm(h, "norm.weight") @ w["lm_head.weight"].T
        return logits, h

    def drafts(self, tokens: list[int], streams: torch.Tensor, k: int) -> list[int]:
        """Greedy drafts after `tokens`, token p reading the target's streams at p - 1, then its own."""
        inputs = torch.cat([torch.zeros_like(streams[:1]), streams[:-1]])
        g = inputs @ self.w["fc.weight"].T
        tokens, out = list(tokens), []
        with torch.no_grad():
            for _ in range(k):
                logits, h = self.run(tokens, g)
                out.append(int(logits[-1].argmax()))
                tokens.append(out[-1])
                g = torch.cat([g, h[-1:]])
        return out


def test_the_target_returns_the_layers_a_head_asks_for(target, tokenizer, target_model):
    toks = tokenizer(PROMPT)["input_ids"]
    info = target.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.num_layers == 2 and info.feature_dim == target_model.config.hidden_size
    first = score(target.stub, "e3-1", toks, 0, toks[:-3], features=F32, feature_layers=LAYERS)
    rest = score(target.stub, "e3-1", toks, len(toks) - 3, toks[-3:], k=2, features=F32, feature_layers=LAYERS)
    assert first.features.dim == len(LAYERS) * info.feature_dim and rest.features.rows == 3
    got = torch.cat([decode_features(first.features), decode_features(rest.features)])
    ref = _layer_streams(target_model, toks)
    assert float((got - ref).abs().max()) < 1e-4 * (1 + float(ref.abs().max()))
    # Another order is another layout: the blocks follow the request.
    swapped = score(target.stub, "e3-2", toks, 0, toks, features=F32, feature_layers=LAYERS[::-1])
    h = info.feature_dim
    assert float((decode_features(swapped.features)[:, :h] - ref[:, h:]).abs().max()) < 1e-4 * (1 + float(ref.abs().max()))
    assert float((decode_features(swapped.features)[:, h:] - ref[:, :h]).abs().max()) < 1e-4 * (1 + float(ref.abs().max()))


@pytest.mark.parametrize("layers, fields, message", [
    ((2,), {"features": F32}, "layer 2 does not exist"),
    ((1, 1), {"features": F32}, "distinct"),
    ((0,), {}, "set features"),
])
def test_bad_feature_layers_are_invalid_argument(target, tokenizer, layers, fields, message):
    toks = tokenizer(PROMPT)["input_ids"]
    with pytest.raises(grpc.RpcError) as err:
        score(target.stub, "e3-bad", toks, 0, toks, feature_layers=layers, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_the_published_head_loads_unchanged_and_drafts_as_published(head, tokenizer, target_model):
    svc, folder = head
    info = svc.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    hidden = target_model.config.hidden_size
    assert info.feature_dim == len(LAYERS) * hidden and info.feature_kind == "layers:0,1"
    assert info.vocab_size == target_model.config.vocab_size and "eagle3" in info.model_name
    toks = tokenizer(PROMPT)["input_ids"]
    streams = _layer_streams(target_model, toks)
    reference = PublishedHead(folder, target_model)
    expected = reference.drafts(toks, streams, 4)
    inputs = torch.cat([torch.zeros_like(streams[:1]), streams[:-1]])
    got = propose(svc.stub, "e3-h1", toks, 0, toks, k=4, features=encode_features(inputs, F32))
    assert list(got.tokens) == expected
    assert all(t in set(reference.ids.tolist()) for t in got.tokens)  # drafts are target ids via d2t
    # Fed in two calls, the rest of the prompt with its rows: the same drafts.
    propose(svc.stub, "e3-h2", toks, 0, toks[:-4], k=0, features=encode_features(inputs[:-4], F32))
    again = propose(svc.stub, "e3-h2", toks, len(toks) - 4, toks[-4:], k=4,
                    features=encode_features(inputs[-4:], F32))
    assert list(again.tokens) == expected
    # The head reads the features: other ones, other drafts.
    other = propose(svc.stub, "e3-h3", toks, 0, toks, k=4, features=encode_features(inputs * -2.0, F32))
    assert list(other.tokens) != expected


def test_a_head_with_its_own_embedding_and_bad_folders(tiny_pair, tmp_path):
    from engine.model import loader
    from tests.tiny import build_eagle3_head

    torch.set_num_threads(1)
    own = build_eagle3_head(tiny_pair[0], tmp_path / "own", with_embedding=True, seed=3)
    loaded = loader.load(str(own), base=str(tiny_pair[0]))
    from safetensors.torch import load_file
    assert torch.equal(loaded.model.get_input_embeddings().weight, load_file(str(own / "model.safetensors"))
                       ["embed_tokens.weight"])
    with pytest.raises(ValueError, match="aux layers"):  # a layer the 2-layer target lacks
        loader.load(str(build_eagle3_head(tiny_pair[0], tmp_path / "deep", layers=(0, 5))), base=str(tiny_pair[0]))
    broken = build_eagle3_head(tiny_pair[0], tmp_path / "broken")
    from safetensors.torch import save_file
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="hidden_norm"):
        loader.load(str(broken), base=str(tiny_pair[0]))

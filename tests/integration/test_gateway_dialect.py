"""The clients' dialect through real processes and the real `openai` SDK: the served model ids,
vLLM's request extensions, continuous usage stats, and tool calling.

One stack of its own: a tiny target and draft (real Redis), two orchestrators on them (the tiny
pair's chat template, which takes no tools, and a copy of its tokenizer with a template that
does: tests/tiny.py TOOL_CHAT_TEMPLATE; the vocabulary is the same, so the services accept both),
and a gateway in front of each (the second with --served-model-name).
"""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from benchmarks.features import tools as tools_bench
from tests.integration.stack import Stack, post_json

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "The cat sat on the mat."}]


def _client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def dialect(tiny_pair, tmp_path_factory):
    target_dir, draft_dir = tiny_pair
    tool_tokenizer = tmp_path_factory.mktemp("tool-template") / "tokenizer"
    _tool_tokenizer(target_dir, tool_tokenizer)
    stack = Stack(logs=tmp_path_factory.mktemp("dialect-logs"))
    try:
        stack.start_service("target", "target", target_dir)
        stack.start_service("draft", "draft", draft_dir)
        stack.start_orchestrator("orch", target_dir)
        stack.start_orchestrator("tools", tool_tokenizer)
        plain = stack.start_gateway("orch")
        named = stack.start_gateway("tools", ("--served-model-name", "tiny-tools,other-alias"))
        yield SimpleNamespace(stack=stack, plain=plain, named=named, openai=_client(plain),
                              tools=_client(named))
    finally:
        stack.stop()


def _tool_tokenizer(source, out) -> None:
    from transformers import AutoTokenizer

    from tests.tiny import TOOL_CHAT_TEMPLATE

    out.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(source)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(out)
    shutil.copy(source / "config.json", out / "config.json")


# ------------------------------------------------------------------- model ids


def test_the_model_id_is_the_targets_name_and_specdec_stays_an_alias(dialect):
    cards = dialect.openai.models.list().data
    assert [c.id for c in cards] == ["target", "specdec"]  # the tiny target's folder name
    assert cards[0].model_extra["max_model_len"] == 512 and cards[0].model_extra["root"] == "target"
    for name in ("target", "specdec"):
        done = dialect.openai.chat.completions.create(model=name, messages=CHAT, max_tokens=3, temperature=0)
        assert done.model == "target"
    status, reply = post_json(f"{dialect.plain}/v1/chat/completions",
                              {"model": "gpt-4o", "messages": CHAT, "max_tokens": 2})
    assert status == 404 and reply["error"]["param"] == "model" and reply["error"]["code"] == "model_not_found"
    assert "'target', 'specdec'" in reply["error"]["message"]
    assert dialect.openai.models.retrieve("specdec").id == "specdec"
    with pytest.raises(openai.NotFoundError):
        dialect.openai.models.retrieve("gpt-4o")


def test_served_model_names_are_aliases_the_first_one_reported(dialect):
    assert [c.id for c in dialect.tools.models.list().data] == ["tiny-tools", "other-alias", "specdec"]
    done = dialect.tools.completions.create(model="other-alias", prompt="The cat", max_tokens=2)
    assert done.model == "tiny-tools"


# ------------------------------------------------------------------- the request extensions


def _grpc(dialect):
    from client import Client

    return Client(dialect.stack.addresses["orch"], timeout=120)


def test_ignore_eos_gives_exactly_max_tokens_streamed_and_not(dialect):
    for proposer in ("none", "default"):
        extra = {"ignore_eos": True, "speculation": {"proposer": proposer}}
        done = dialect.openai.chat.completions.create(model="target", messages=CHAT, max_tokens=40,
                                                      temperature=0, extra_body=extra)
        assert done.usage.completion_tokens == 40 and done.choices[0].finish_reason == "length"
        text = dialect.openai.completions.create(model="target", prompt="The cat", max_tokens=40,
                                                 temperature=0.7, seed=3, extra_body=extra)
        assert text.usage.completion_tokens == 40
    usages = []
    for chunk in dialect.openai.chat.completions.create(
            model="target", messages=CHAT, max_tokens=40, stream=True, temperature=0,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True}):
        assert chunk.usage is not None  # every chunk, with continuous_usage_stats
        usages.append(chunk.usage)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == 40 and usages[-1].prompt_tokens == done.usage.prompt_tokens
    assert usages[-1].model_extra.get("speculation") is not None  # the last one is the whole usage
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


def test_min_tokens_and_stop_token_ids_match_the_grpc_path_under_every_proposer(dialect):
    with _grpc(dialect) as grpc_client:
        plain = grpc_client.complete(messages=CHAT, max_new_tokens=24, temperature=0.0, proposer="none")
        stop = plain.token_ids[4]
        want = grpc_client.complete(messages=CHAT, max_new_tokens=24, temperature=0.0, proposer="none",
                                    stop_token_ids=[stop])
        assert list(want.token_ids) == list(plain.token_ids[:plain.token_ids.index(stop) + 1])
        for proposer in ("none", "draft", "default"):
            extra = {"stop_token_ids": [stop], "speculation": {"proposer": proposer, "k": 3}}
            done = dialect.openai.chat.completions.create(model="target", messages=CHAT, max_tokens=24,
                                                          temperature=0, extra_body=extra)
            assert done.choices[0].message.content == want.text
            assert done.choices[0].finish_reason == "stop"
            assert done.usage.completion_tokens == len(want.token_ids)
            # min_tokens = max_tokens: no EOS (nor the stop token) can end it early
            extra = {"min_tokens": 24, "stop_token_ids": [stop], "speculation": {"proposer": proposer}}
            full = dialect.openai.chat.completions.create(model="target", messages=CHAT, max_tokens=24,
                                                          temperature=0, extra_body=extra)
            assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
            if proposer == "none":
                reference = full.choices[0].message.content
            assert full.choices[0].message.content == reference


def test_include_stop_str_in_output_and_special_tokens(dialect):
    base = dialect.openai.completions.create(model="target", prompt="The cat", max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    cut = dialect.openai.completions.create(model="target", prompt="The cat", max_tokens=16, temperature=0,
                                            stop=[stop], extra_body={"ignore_eos": True,
                                                                     "include_stop_str_in_output": True})
    assert cut.choices[0].text == base[:base.index(stop) + len(stop)]
    shown = dialect.openai.completions.create(model="target", prompt="The cat", max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.choices[0].text.replace("<|im_end|>", "").replace("<|im_start|>", "").replace(
        "<|endoftext|>", "") == base


@pytest.mark.parametrize("body, param", [
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
    ({"top_k": -2}, "top_k"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(dialect, body, param):
    status, reply = post_json(f"{dialect.plain}/v1/chat/completions",
                              {"model": "target", "messages": CHAT, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_neutral_values_and_top_k_minus_one_are_accepted(dialect):
    status, reply = post_json(f"{dialect.plain}/v1/chat/completions", {
        "model": "target", "messages": CHAT, "max_tokens": 4, "repetition_penalty": 1.0, "top_k": -1,
        "min_p": 0.05, "stop": None, "ignore_eos": False, "skip_special_tokens": True})
    assert status == 200, reply


# ------------------------------------------------------------------- tools


def test_required_tool_calls_validate_and_are_identical_under_speculation(dialect):
    """The 20 schema/prompt pairs of benchmarks/prompts/tools-v1.jsonl through the SDK:
    target-only and the default configuration, and streamed."""
    result = tools_bench.run(dialect.plain, model="target", max_tokens=256)
    print("\n" + tools_bench.report(result))
    s = result["summary"]
    bad = [r for r in result["rows"] if not (r["none"]["valid"] and r["default"]["valid"] and r["identical"]
                                             and r["stream_identical"])]
    assert s["pairs"] == 20 and not bad, bad


def test_a_named_function_among_several_and_the_history_of_a_call(dialect):
    pairs = tools_bench.load_pairs()
    functions = [p["tool"] for p in pairs[:3]]
    done = dialect.openai.chat.completions.create(
        model="target", messages=CHAT, tools=functions, temperature=0, max_tokens=256,
        tool_choice={"type": "function", "function": {"name": functions[1]["function"]["name"]}})
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].finish_reason == "tool_calls" and tools_bench.validates(pairs[1], call)
    both = dialect.openai.chat.completions.create(model="target", messages=CHAT, tools=functions[:2],
                                                  tool_choice="required", temperature=0, max_tokens=256)
    chosen = both.choices[0].message.tool_calls[0]
    assert any(tools_bench.validates(p, chosen) for p in pairs[:2])
    history = [*CHAT, done.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    follow = dialect.openai.chat.completions.create(model="target", messages=history, max_tokens=8)
    assert follow.usage.prompt_tokens > done.usage.prompt_tokens


def test_auto_needs_a_template_that_takes_tools(dialect):
    tool = tools_bench.load_pairs()[0]["tool"]
    with pytest.raises(openai.BadRequestError) as err:
        dialect.openai.chat.completions.create(model="target", messages=CHAT, tools=[tool], max_tokens=4)
    assert err.value.body["param"] == "tool_choice" and "no tools" in err.value.body["message"]
    bare = dialect.tools.chat.completions.create(model="tiny-tools", messages=CHAT, max_tokens=4, temperature=0)
    auto = dialect.tools.chat.completions.create(model="tiny-tools", messages=CHAT, tools=[tool],
                                                 max_tokens=4, temperature=0)
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the template shows the tools
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = "".join(c.choices[0].delta.content or "" for c in dialect.tools.chat.completions.create(
        model="tiny-tools", messages=CHAT, tools=[tool], max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == (auto.choices[0].message.content or "")
    print(json.dumps(auto.choices[0].message.model_dump()))

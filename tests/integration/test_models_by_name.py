"""A target served by its Hugging Face id, offline from a hub cache, through real processes and the
`openai` SDK: the id is the API's model id, /v1/models lists it with --max-model-len, a request
past that length is a 400, and the orchestrator's --chat-template is the template applied.

One stack of its own: the target service `--model acme/tiny-target --revision <commit>
--max-model-len 64`, an orchestrator `--tokenizer acme/tiny-target --chat-template FILE` and a
gateway, every process with HF_HUB_OFFLINE=1 and HF_HOME at a cache built from the tiny target
(tests/hubcache.py). No draft: the proposers fall back to target-only, which is all this needs.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.hubcache import publish
from tests.integration.stack import ENV, Stack

openai = pytest.importorskip("openai")

REPO = "acme/tiny-target"
MAX_LEN = 64
TEMPLATE = ("{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}")
CHAT = [{"role": "user", "content": "The cat sat on the mat."}]


@pytest.fixture(scope="module")
def served(tiny_pair, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    commit = publish(tiny_pair[0], home / "hub", REPO)
    template = home / "template.jinja"
    template.write_text(TEMPLATE)
    stack = Stack(logs=tmp_path_factory.mktemp("by-name-logs"))
    stack.processes.env = {**ENV, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    try:
        stack.start_service("target", "target", REPO,
                            extra=("--revision", commit, "--max-model-len", str(MAX_LEN)))
        stack.start_orchestrator("orch", REPO, extra=("--chat-template", str(template)))
        base = stack.start_gateway("orch")
        yield SimpleNamespace(stack=stack, base=base, folder=tiny_pair[0], client=openai.OpenAI(
            base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120))
    finally:
        stack.stop()


def test_the_hub_id_is_the_model_id_listed_with_max_model_len(served):
    cards = served.client.models.list().data
    assert [c.id for c in cards] == [REPO, "specdec"]
    assert cards[0].model_extra["max_model_len"] == MAX_LEN and cards[0].model_extra["root"] == REPO
    assert served.client.models.retrieve(REPO).id == REPO  # a slash in the path
    done = served.client.chat.completions.create(model=REPO, messages=CHAT, max_tokens=4, temperature=0)
    assert done.model == REPO and done.choices[0].message.content is not None
    assert done.usage.completion_tokens >= 1


def test_the_chat_template_given_is_the_one_applied(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.folder)
    own = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    tokenizer.chat_template = TEMPLATE
    given = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert given == "[user] The cat sat on the mat.\n[assistant] " and given != own
    done = served.client.chat.completions.create(model=REPO, messages=CHAT, max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens == len(tokenizer.encode(given, add_special_tokens=False))


def test_a_request_longer_than_max_model_len_is_a_400(served):
    long = "The cat sat on the mat and the dog sat on the log. " * 8  # well over 64 tokens
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=REPO, prompt=long, max_tokens=2)
    assert f"does not fit the target's context of {MAX_LEN}" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model=REPO, prompt="The cat", max_tokens=MAX_LEN)
    assert f"exceeds the target's context of {MAX_LEN}" in info.value.message
    done = served.client.completions.create(model=REPO, prompt="The cat", max_tokens=MAX_LEN - 8)
    assert done.usage.prompt_tokens + done.usage.completion_tokens <= MAX_LEN

"""Incremental detokenisation with a real byte-level BPE tokenizer (the tiny target's)."""
from __future__ import annotations

import pytest

from orchestrator.common.text import IncrementalDecoder, encode_prompt
from specdec.runtime.errors import InvalidArgument

TEXTS = ["héllo wörld", "naïve café — ünïcode ✓", "emoji 😀👍🏽 and 中文字符 mixed", "plain ascii"]


@pytest.fixture(scope="module")
def tok(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_are_held_until_complete(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    dec = IncrementalDecoder(tok, context=tok.encode("Say:", add_special_tokens=False))
    deltas = [dec.push([t]) for t in ids]
    deltas.append(dec.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_chunks_of_several_tokens_and_special_tokens(tok):
    ids = tok.encode("a ✓ b", add_special_tokens=False) + [tok.eos_token_id]
    dec = IncrementalDecoder(tok)
    out = dec.push(ids[:2]) + dec.push(ids[2:]) + dec.flush()
    assert out == "a ✓ b"  # EOS is committed but has no text


def test_a_truly_invalid_sequence_ends_as_the_full_decode(tok):
    lone = tok.encode("✓", add_special_tokens=False)[:1]  # the first byte of three
    dec = IncrementalDecoder(tok)
    assert dec.push(lone) == ""  # held: it might still complete
    assert dec.flush() == tok.decode(lone)  # at the end: what a full decode shows


def test_prompt_encoding_rules(tok):
    assert encode_prompt(tok, "hi", []) == tok.encode("hi", add_special_tokens=False)
    with pytest.raises(InvalidArgument, match="prompt"):
        encode_prompt(tok, "", [])
    with pytest.raises(InvalidArgument, match="both"):
        encode_prompt(tok, "hi", [("user", "hi")])
    chat = encode_prompt(tok, "", [("user", "hi")])
    assert tok.decode(chat).startswith("<|im_start|>user\nhi<|im_end|>")


def test_the_fast_decode_is_the_tokenizers_own(tok):
    """The decoder reads the fast tokenizer's backend directly: the same text as
    tokenizer.decode(skip_special_tokens=True, no clean-up), special tokens included."""
    import random

    dec = IncrementalDecoder(tok)
    assert dec._backend is not None  # the tiny target's tokenizer is a fast one
    rng = random.Random(7)
    specials = [tok.eos_token_id, *(tok.all_special_ids or [])]
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
        ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        assert dec._decode(ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

"""orchestrator.common.grammar on the tiny tokenizer: masks along a draft, the cut rule, forced tokens, rollback."""
from __future__ import annotations

import json

import pytest

from orchestrator.common.grammar import Constraint, Grammars
from specdec.core import masks
from specdec.runtime.errors import InvalidArgument

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}},
          "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture()
def matcher(tok):
    return Grammars(tok, len(tok), [tok.eos_token_id]).matcher(Constraint("json_schema", json.dumps(SCHEMA)))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_masks_follow_the_draft_and_roll_back(tok, matcher):
    good = _ids(tok, '{"name":"ab"}')
    first = matcher.round_masks(good[:3], send_first_invalid=False)
    assert first.valid == first.sent == 3 and first.words.shape[0] == 4
    assert all(masks.allows(first.words[i], t) for i, t in enumerate(good[:3]))
    again = matcher.round_masks(good[:3], send_first_invalid=False)  # rolled back: the same masks
    assert (again.words == first.words).all()


def test_a_forbidden_draft_token_is_cut_or_sent_by_the_rule(tok, matcher):
    bad = _ids(tok, "x")[0]
    assert not masks.allows(matcher.round_masks([], False).words[0], bad)
    cut = matcher.round_masks([bad, bad], send_first_invalid=False)
    sent = matcher.round_masks([bad, bad], send_first_invalid=True)
    assert (cut.valid, cut.sent) == (0, 0) and (sent.valid, sent.sent) == (0, 1)
    assert sent.proposal([bad, bad]) == [bad] and sent.words.shape[0] == 2


def test_forced_tokens_fill_the_draft_and_are_allowed(tok, matcher):
    matcher.commit(_ids(tok, "{"))
    r = matcher.round_masks([], send_first_invalid=False, k=4)
    assert r.forced, "after '{' the key is forced"
    assert tok.decode(list(r.forced)) == '"name":"'[:len(tok.decode(list(r.forced)))]
    assert all(masks.allows(r.words[i], t) for i, t in enumerate(r.forced))
    assert r.words.shape[0] == len(r.forced) + 1
    assert matcher.round_masks([], send_first_invalid=False, k=0).forced == ()  # k bounds them


def test_eos_ends_the_grammar(tok, matcher):
    matcher.commit(_ids(tok, '{"name":"ab"}'))
    assert matcher.done
    r = matcher.round_masks([tok.eos_token_id, 5], send_first_invalid=False, k=2)
    assert r.valid == r.sent == 1 and r.forced == ()
    matcher.commit([tok.eos_token_id])  # an EOS is never fed, so this is no error


@pytest.mark.parametrize("constraint,field", [
    (Constraint("regex", "[a-"), "constraint.regex"),
    (Constraint("json_schema", "[1, 2]"), "constraint.json_schema"),
    (Constraint("lark", "start: missing"), "constraint.lark"),
])
def test_bad_grammars_name_their_field(tok, constraint, field):
    with pytest.raises(InvalidArgument, match=field):
        Grammars(tok, len(tok), [tok.eos_token_id]).matcher(constraint)


@pytest.mark.parametrize("constraint", [Constraint("regex", "[^\\x00-\\x{10FFFF}]"), Constraint("lark", "start: start")])
def test_a_grammar_that_matches_nothing_is_invalid_argument(tok, constraint):
    with pytest.raises(InvalidArgument, match="constraint"):
        Grammars(tok, len(tok), [tok.eos_token_id]).matcher(constraint)


def test_a_token_that_leads_nowhere_counts_as_forbidden(tok):
    # `b` then the rule `never`, which matches no text: after "ab" nothing can follow.
    grammar = 'start: "a" ("c" | "b" never)\nnever: never "x"'
    m = Grammars(tok, len(tok), [tok.eos_token_id]).matcher(Constraint("lark", grammar))
    a, b = _ids(tok, "a")[0], _ids(tok, "b")[0]
    r = m.round_masks([a, b], send_first_invalid=False, k=2)
    assert r.valid == 1 and r.sent == 1  # "b" is cut: it leads nowhere
    assert not masks.allows(r.words[1], b)


def test_a_tree_keeps_the_nodes_the_grammar_allows_with_each_paths_own_mask(tok, matcher):
    """TurnMatcher.tree_masks: a node the grammar forbids goes with its subtree, an EOS node keeps
    no children, and each kept node's row is the chain mask after its own path."""
    good = _ids(tok, '{"name":"ab"}')
    bad = _ids(tok, "x")[0]
    # 0: good[0]; 1: good[1] under 0; 2: bad under 0 (dropped); 3: good[2] under 1;
    # 4: good[1] under 2 (its parent is dropped); 5: bad at the root (dropped); 6: EOS under 1
    # (a JSON object is not complete there: dropped); 7: good[2] under 1 again (a sibling copy).
    tokens = [good[0], good[1], bad, good[2], good[1], bad, tok.eos_token_id, good[2]]
    parents = [-1, 0, 0, 1, 2, -1, 1, 1]
    kept, words = matcher.tree_masks(tokens, parents)
    assert kept == [0, 1, 3, 7]
    assert words.shape[0] == len(kept) + 1
    chain = matcher.round_masks(good[:3], send_first_invalid=False)  # rows 0..3 along good[:3]
    for row, want in ((0, 0), (1, 1), (2, 2), (3, 3), (4, 3)):
        assert (words[row] == chain.words[want]).all(), row
    assert (matcher.round_masks([], False).words[0] == words[0]).all()  # the matcher was rolled back
    # At the end of the object an EOS node is kept and nothing after it.
    matcher.commit(good)
    kept, words = matcher.tree_masks([tok.eos_token_id, good[0]], [-1, 0])
    assert kept == [0] and words.shape[0] == 2

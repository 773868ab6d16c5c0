"""Structured output: the grammar a turn's tokens must follow, and its masks for a round.

The matcher is llguidance's (`LLMatcher`): a Rust Earley parser over token
bytes, no torch, that computes a whole-vocabulary mask in tens of
microseconds, rolls back consumed tokens, and compiles JSON Schema, regular
expressions and Lark grammars. It is what the orchestrator needs in a
speculative round: masks for every drafted position (advance along the draft,
then roll back) before the target scores them.

A round (orchestrator.round.loop):
  1. `round_masks(drafted)`: the allowed tokens at each of the k + 1 scored
     positions, advancing along the drafted tokens and rolling back; where a
     drafted token is disallowed the draft is cut (see `RoundMasks.sent`);
  2. the target applies the masks to its logits (model.proto TokenMasks), so
     greedy takes the masked argmax and sampling the masked, renormalised p;
  3. `commit(tokens)` advances the matcher along what the round committed.

The matcher lives for one turn in the orchestrator's memory: a resume or a
retried turn regenerates the turn from its start, so it is rebuilt from the
request, never stored.

A constraint is compiled once per request, off the event loop, on the
grammars' own threads and within --grammar-compile-s (`Grammars.compiled`;
llguidance releases the GIL while it compiles): a `CompiledGrammar` holds a
matcher at the grammar's start, its lexer warmed by a first mask, and every
turn of the request (each choice when n > 1) starts from a copy of it. The
last few compiled constraints are kept (an LRU, refusals included), so a
schema sent with every request compiles once.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
from prometheus_client import Counter

from specdec.core import masks
from specdec.runtime.errors import InvalidArgument

COMPILES = Counter("specdec_grammar_compiles_total",
                   "Constraints looked up for compiling, by outcome: compiled, refused (a bad grammar), "
                   "cached (compiled or refused before: orchestrator.common.grammar.Grammars)", ["outcome"])
JSON_OBJECT_SCHEMA = {"type": "object"}
# Compact JSON without free whitespace: a free-whitespace grammar lets a weak model
# fill its budget with blanks.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """A request's grammar: `kind` is "json_schema", "json_object", "regex" or "lark"."""

    kind: str
    text: str = ""


def to_grammar(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked: `Grammars.compile` does)."""
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=_JSON_OPTIONS)
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.text)
        except ValueError as exc:
            raise InvalidArgument(f"constraint.json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("constraint.json_schema must be a JSON object (a schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if constraint.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(constraint.text)
    raise InvalidArgument(f"constraint: unknown kind {constraint.kind!r}")


class CompiledGrammar:
    """A checked grammar: a matcher at its start (its lexer warmed), copied for each turn."""

    def __init__(self, start: llguidance.LLMatcher, vocab_size: int, eos_ids) -> None:
        self._start, self._vocab_size, self._eos = start, vocab_size, eos_ids
        self.matcher()  # a grammar that matches nothing fails here; the first mask warms the lexer

    def matcher(self) -> TurnMatcher:
        """A fresh matcher for one turn (a copy: no compiling)."""
        return TurnMatcher(self._start.deep_copy, self._vocab_size, self._eos)


class Grammars:
    """The orchestrator's grammar compiler: the tokenizer's byte table, built once (about 1 s), and
    the last `cache_size` constraints compiled, on `threads` threads of its own."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, *, cache_size: int = 32, threads: int = 2):
        self._vocab_size = vocab_size  # 0: the tokenizer's own size (resolved on first use)
        self._hf = tokenizer
        self._eos = sorted(eos_ids)
        self._ll = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, CompiledGrammar | str] = OrderedDict()  # str: the refusal
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="grammar")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size or len(self._hf)

    def _tokenizer(self):
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                        eos_token=self._eos or None)
            return self._ll

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (a piece of a UTF-8 character stays a piece); a special token: its name."""
        raw = self._tokenizer().decode_bytes([token])
        if raw.startswith(b"\xff"):  # llguidance's marker of a special token
            return str(self._hf.convert_ids_to_tokens(token)).encode()
        return raw

    def warm(self) -> None:
        """Build the tokenizer's byte table now (log-probabilities' bytes read it on the loop)."""
        self._tokenizer()

    def matcher(self, constraint: Constraint) -> TurnMatcher:
        """A fresh matcher for one turn; INVALID_ARGUMENT naming the field if the grammar is bad."""
        return self.compile(constraint).matcher()

    async def compiled(self, constraint: Constraint, timeout_s: float) -> CompiledGrammar:
        """`compile` on the grammars' threads; INVALID_ARGUMENT when it takes over `timeout_s`
        (the compile goes on there and is cached: the same constraint again is served at once)."""
        future = asyncio.wrap_future(self._pool.submit(self.compile, constraint))
        try:
            return await asyncio.wait_for(future, timeout_s if timeout_s > 0 else None)
        except asyncio.TimeoutError:
            raise InvalidArgument(f"constraint.{constraint.kind}: not compiled within {timeout_s:g} s "
                                  "(--grammar-compile-s); simplify the grammar") from None

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's grammar, checked and warmed (cached); INVALID_ARGUMENT naming the field
        if it is bad. Runs on any thread; slow for a large grammar (use `compiled` on the loop)."""
        with self._lock:
            known = self._cache.get(constraint)
            if known is not None:
                self._cache.move_to_end(constraint)
        if known is None:
            try:
                known = self._compile(constraint)
            except InvalidArgument as exc:
                known = str(exc)
            self._keep(constraint, known)
            COMPILES.labels("refused" if isinstance(known, str) else "compiled").inc()
        else:
            COMPILES.labels("cached").inc()
        if isinstance(known, str):
            raise InvalidArgument(known)
        return known

    def _keep(self, constraint: Constraint, compiled: CompiledGrammar | str) -> None:
        with self._lock:
            self._cache[constraint] = compiled
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        field = f"constraint.{constraint.kind}"
        try:
            grammar = to_grammar(constraint)
            tokenizer = self._tokenizer()
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            if is_error:
                raise InvalidArgument(f"{field}: {messages[0] if messages else 'invalid'}")
            return CompiledGrammar(llguidance.LLMatcher(tokenizer, grammar), self.vocab_size, self._eos)
        except InvalidArgument:
            raise
        except (ValueError, TypeError, RuntimeError) as exc:  # the compiler's own complaint
            raise InvalidArgument(f"{field}: {exc}") from None


def drafted_to_send(valid: int, drafted: int, send_first_invalid: bool) -> int:
    """How many drafted tokens to score when the grammar allows only the first `valid`.

    A forbidden drafted token is certainly rejected (its masked p is 0), and
    nothing after it can commit this round. Greedy, or a deterministic
    proposal (one-hot q): cut it, the extra token at its place is the same.
    A sampled draft with its q: send it (`send_first_invalid`), so that the
    extra token is recovered from norm(max(0, p - q)) with the masked p. That
    is what keeps the output's distribution exactly the constrained target's;
    cutting it and drawing the bonus from p would not (the draft's mass on
    forbidden tokens would then be resampled from p, over-weighting what q
    and p share).
    """
    return valid + 1 if send_first_invalid and valid < drafted else valid


@dataclass(frozen=True)
class RoundMasks:
    """The masks of one round's scored positions and how much of the draft to send."""

    sent: int  # drafted tokens to send: the valid prefix (+ the first invalid one, see round_masks)
    valid: int  # drafted tokens the grammar allows, consecutively from the start
    words: np.ndarray  # [sent + len(forced) + 1, words] int32: [i] = the tokens allowed at scored position i
    forced: tuple[int, ...] = ()  # grammar-forced tokens proposed after the first `sent` drafted ones

    def proposal(self, drafted: list[int]) -> list[int]:
        """The tokens the round scores: the sent drafted ones, then the forced ones."""
        return list(drafted[: self.sent]) + list(self.forced)


class TurnMatcher:
    """One turn's grammar state, advanced along committed tokens only."""

    def __init__(self, new_matcher, vocab_size: int, eos_ids=()):
        self._new = new_matcher  # () -> a fresh llguidance.LLMatcher at the grammar's start
        self._m = new_matcher()
        self._committed: list[int] = []  # what the matcher has consumed (to rebuild it)
        self._words = masks.words_per_position(vocab_size)
        # An end of sequence ends the turn: it is checked against the mask but never fed to
        # the matcher (nothing follows it, and a consumed EOS does not roll back cleanly).
        self._eos = frozenset(eos_ids)
        self._check()
        self.round_masks([], send_first_invalid=False)  # a grammar that matches nothing fails here

    def _check(self) -> None:
        if self._m.is_error():
            raise InvalidArgument(f"constraint: the grammar cannot go on: {self._m.get_error()}")

    def round_masks(self, drafted: list[int], send_first_invalid: bool, k: int | None = None) -> RoundMasks:
        """Masks for the positions of drafted[0..] and the one after the last drafted token sent.

        The draft is cut after its valid prefix as `drafted_to_send` says. Where
        it was cut (or came back shorter than `k`) and the grammar forces what
        follows (the bytes of a JSON key, a closing bracket: llguidance's
        fast-forward tokens), those tokens fill the draft up to k: proposals
        with a one-hot q, verified by the target like any other, so the output
        is unchanged and fewer target passes make it. A token after which the
        grammar allows nothing (a rule that matches no text) counts as
        forbidden. The mask after a sent invalid token is never used (that
        position cannot commit): it allows every token.
        """
        k = len(drafted) if k is None else k
        words = np.full((max(k, len(drafted)) + 1, self._words), -1, dtype=np.int32)
        path: list[int] = []  # the tokens the matcher went along: the valid drafts, then forced ones
        valid, ended = 0, False
        self._dead = False  # set by _fill at a dead end (the matcher is then rebuilt, at the start)
        for token in drafted:
            self._fill(words, len(path))
            if self._dead or not masks.allows(words[len(path)], token):
                break
            if token in self._eos:  # allowed: the turn ends here; the mask after it is never used
                valid, ended = valid + 1, True
                break
            if not self._m.consume_token(token):
                break
            path.append(token)
            valid += 1
        sends_invalid = send_first_invalid and not ended and valid < len(drafted)
        if not ended and not sends_invalid and not self._dead:
            if valid < k:
                for token in self._m.compute_ff_tokens()[: k - valid]:
                    self._fill(words, len(path))
                    if self._dead or token in self._eos or not masks.allows(words[len(path)], token) \
                            or not self._m.consume_token(token):
                        break
                    path.append(token)
            if not self._dead:
                self._fill(words, len(path))
        if not self._dead:  # a rebuilt matcher already stands at the committed tokens
            self._m.rollback(len(path))
        self._check()
        # A token whose next mask is empty leads nowhere: forbid it and cut the path before it.
        # Rows 0..len(path) were computed (the last: where the drafts stopped, or after the path).
        dead = next((i for i in range(len(path) + 1) if not words[i].any()), None)
        if dead == 0:
            raise InvalidArgument("constraint: the grammar allows no token here (does a rule match no text?)")
        if dead is not None:
            masks.forbid(words[dead - 1], path[dead - 1])
            path = path[: dead - 1]
            valid = min(valid, dead - 1)
        forced = path[valid:]
        sent = valid if ended else drafted_to_send(valid, len(drafted), send_first_invalid)
        if sent > valid:  # the invalid token sent: the mask after it is never used
            forced = []
            words[valid + 1] = -1
        return RoundMasks(sent=sent, valid=valid, words=words[: sent + len(forced) + 1], forced=tuple(forced))

    def tree_masks(self, tokens: list[int], parents: list[int]) -> tuple[list[int], np.ndarray]:
        """A token tree's grammar: (the nodes it allows, in order; their masks).

        A node is kept where the grammar allows its token after its path (and
        its parent was kept); a token after which the grammar allows nothing, or
        any child of an end token, is dropped with its subtree. The masks: row 0
        at the committed tokens, then the row after each kept node, in order
        (the rows a tree's Score emits). Dropping a forbidden node changes no
        outcome: the target's masked p is 0 there, so it is never its argmax or
        draw, and recursive rejection of a one-hot candidate with p 0 leaves p
        as it was.
        """
        words = np.full((len(tokens) + 1, self._words), -1, dtype=np.int32)
        self._dead = False
        self._fill(words, 0)
        if self._dead or not words[0].any():
            raise InvalidArgument("constraint: the grammar allows no token here (does a rule match no text?)")
        paths: dict[int, list[int]] = {-1: []}  # a kept node's tokens from the committed ones
        ended: set[int] = set()  # kept end tokens: nothing follows them
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if parent not in paths or parent in ended or not masks.allows(words[parent + 1], token):
                continue
            if token in self._eos:  # its row is never used (the turn ends there): it allows every token
                paths[i] = paths[parent] + [token]
                ended.add(i)
                continue
            path = paths[parent] + [token]
            fed = 0
            for t in path:
                if not self._m.consume_token(t):
                    break
                fed += 1
            self._dead = False
            if fed == len(path):
                self._fill(words, i + 1)
            if not self._dead:  # a rebuilt matcher already stands at the committed tokens
                self._m.rollback(fed)
            if fed == len(path) and not self._dead and words[i + 1].any():
                paths[i] = path
        self._check()
        kept = sorted(i for i in paths if i >= 0)
        return kept, words[[0] + [i + 1 for i in kept]]

    def _fill(self, words: np.ndarray, i: int) -> None:
        """The mask at position i; empty where the matcher went into its error state (a dead end:
        llguidance stays there, so the matcher is rebuilt at the committed tokens)."""
        view = words[i]
        self._m.unsafe_compute_mask_ptr(view.ctypes.data, view.size * view.itemsize)
        if self._m.is_error():
            view[:] = 0
            self._m = self._new()
            if self._committed and not self._m.consume_tokens(self._committed):
                raise InvalidArgument(f"constraint: the grammar cannot go on: {self._m.get_error()}")
            self._dead = True

    def commit(self, tokens: list[int]) -> None:
        """Advance along a round's committed tokens (each one the target took under the mask)."""
        if tokens and tokens[-1] in self._eos:
            tokens = tokens[:-1]  # a committed EOS is the last token (the turn ends)
        if tokens and not self._m.consume_tokens(tokens):
            raise InvalidArgument(f"constraint: the grammar refused a committed token: {self._m.get_error()}")
        self._committed.extend(tokens)

    @property
    def done(self) -> bool:
        """The grammar accepts nothing more but an end of sequence."""
        return self._m.is_stopped()

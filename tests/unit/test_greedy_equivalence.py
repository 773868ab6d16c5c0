"""Greedy equivalence: speculative greedy decoding equals plain greedy decoding.

The "models" are fixed random logit tables indexed by the last two tokens; the
draft is the target plus noise. Two stand-in caches (a list of tokens with the
services' crop-then-append contract) check the KV keep-length arithmetic on
the way: every request's cache_position must point at a cache prefix that
equals the committed prefix, so keeping a rejected drafted token, or losing the
draft's catch-up token, fails the test. Every proposer kind (draft model, prompt
lookup, a user guess) and every k in 0..8 is run, through verify_greedy and
through the sampling verifier with one-hot (temperature 0) distributions.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec.core.kv import draft_catch_up, keep_lengths, uncached
from specdec.core.lookup import PromptLookup
from specdec.core.sampling import SamplingParams, probs_from_logits
from specdec.core.stopping import clip_to_stop
from specdec.core.verify import verify_greedy, verify_sampled

torch.set_num_threads(1)

VOCAB = 24
EOS = 3
MAX_NEW = 48
GREEDY = SamplingParams(temperature=0.0)


class TableModel:
    """next-token logits = table[prev2, prev1]; [vocab, vocab, vocab]."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def logits(self, prefix: list[int]) -> torch.Tensor:  # [vocab]
        return self.table[prefix[-2], prefix[-1]]

    def argmax(self, prefix: list[int]) -> int:
        return int(self.logits(prefix).argmax())


class CachedService:
    """A model service's KV cache as a token list: crop to cache_position, then append."""

    def __init__(self, model: TableModel) -> None:
        self.model = model
        self.cache: list[int] = []
        self.tokens_fed = 0

    def _feed(self, cache_position: int, tokens: list[int], committed: list[int]) -> None:
        assert cache_position <= len(self.cache), "cache_position beyond what the service holds"
        assert self.cache[:cache_position] == committed[:cache_position], "kept cache holds uncommitted tokens"
        self.cache = self.cache[:cache_position] + tokens
        self.tokens_fed += len(tokens)

    def score(self, cache_position: int, tokens: list[int], n_draft: int, committed: list[int]) -> torch.Tensor:
        """Target: one pass; logits for the last n_draft + 1 positions. [n_draft + 1, vocab]"""
        self._feed(cache_position, tokens, committed)
        n = len(self.cache)
        return torch.stack([self.model.logits(self.cache[:j]) for j in range(n - n_draft, n + 1)])

    def propose(self, cache_position: int, tokens: list[int], k: int, committed: list[int]) -> list[int]:
        """Draft: greedy k tokens; feeds all but the last drafted token (the services' contract)."""
        self._feed(cache_position, tokens, committed)
        drafted: list[int] = []
        for i in range(k):
            drafted.append(self.model.argmax(self.cache))
            if i < k - 1:
                self.cache.append(drafted[-1])
        return drafted


def plain_greedy(model: TableModel, prompt: list[int]) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    while len(out) < MAX_NEW:
        t = model.argmax(seq)
        seq.append(t)
        out.append(t)
        if t == EOS:
            break
    return out


Proposer = Callable[[list[int], int], list[int]]


def speculative_greedy(
    target: TableModel, draft: TableModel | None, prompt: list[int], k: int,
    guess: list[int] | None, use_sampler: bool,
) -> tuple[list[int], int, int]:
    """(new tokens, target passes, draft tokens fed) through the orchestrator's round structure."""
    committed = list(prompt)
    target_svc = CachedService(target)
    draft_svc = CachedService(draft) if draft is not None else None
    lookup = PromptLookup() if draft is None and guess is None else None
    if lookup is not None:
        lookup.extend(committed)
    t_keep = d_keep = 0
    new: list[int] = []
    passes = 0
    while True:
        remaining = MAX_NEW - len(new)
        before = len(committed)
        k_round = min(k, remaining - 1) if remaining > 1 else 0
        # 1. propose
        draft_held = 0
        if draft_svc is not None:
            drafted = draft_svc.propose(d_keep, uncached(committed, d_keep), k_round, committed) if k_round else []
            draft_held = len(draft_svc.cache)
        elif guess is not None:
            drafted = guess[len(new) : len(new) + k_round]
        else:
            drafted = lookup.propose(limit=k_round)
        # 2. score: one target pass over the uncached tokens + drafted
        logits = target_svc.score(t_keep, uncached(committed, t_keep) + drafted, len(drafted), committed)
        passes += 1
        # 3. verify
        if use_sampler:
            verdict = verify_sampled(drafted, None, probs_from_logits(logits, GREEDY), seed=5, position=before)
        else:
            verdict = verify_greedy(drafted, logits.argmax(-1).tolist())
        # 4. commit (cut at EOS / max_new_tokens), crop caches by absolute length
        kept, reason = clip_to_stop(verdict.tokens, eos_ids={EOS}, remaining=remaining)
        committed += kept
        new += kept
        if lookup is not None:
            lookup.extend(kept)
        if draft_svc is None:
            draft_held = 0
        t_keep, d_keep = keep_lengths(
            committed_before=before, n_drafted=len(drafted), n_accepted=verdict.accepted,
            draft_held=draft_held, n_committed=len(kept),
        )
        if draft_svc is not None and drafted and reason is None:
            # The draft is next fed the extra token, plus the catch-up token after full acceptance.
            assert len(committed) - d_keep == 1 + draft_catch_up(n_drafted=len(drafted), n_accepted=verdict.accepted)
        if reason is not None:
            return new, passes, draft_svc.tokens_fed if draft_svc else 0
        assert len(committed) - t_keep == 1  # the target is only ever sent the one new token


PROMPTS = [[1, 2, 5, 7, 1, 2], [9, 4, 11, 4, 9, 4, 11, 6, 9, 4]]


def make_models(seed: int) -> tuple[TableModel, TableModel]:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, VOCAB, VOCAB, generator=gen)
    table[..., EOS] -= 4.0  # EOS only where planted below
    noise = 0.6 * torch.randn(table.shape, generator=gen)
    # Plant an EOS about 30 tokens into the first prompt's continuation, so runs
    # end on EOS (often inside an accepted run) as well as on max_new_tokens.
    seq = list(PROMPTS[0])
    for _ in range(30):
        seq.append(int(table[seq[-2], seq[-1]].argmax()))
    table[seq[-2], seq[-1], EOS] = 20.0
    return TableModel(table), TableModel(table + noise)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["draft", "lookup", "guess"])
def test_speculative_greedy_equals_plain_greedy(seed: int, kind: str) -> None:
    target, draft = make_models(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    for prompt in PROMPTS:
        reference = plain_greedy(target, prompt)
        # A user guess: the true continuation with ~25% of tokens corrupted.
        guess = [t if torch.rand(1, generator=gen) > 0.25 else (t + 1) % VOCAB for t in reference]
        guess += [0] * 10
        for k in range(9):
            for use_sampler in (False, True):
                out, passes, _ = speculative_greedy(
                    target, draft if kind == "draft" else None, prompt, k,
                    guess if kind == "guess" else None, use_sampler,
                )
                assert out == reference, f"k={k} sampler={use_sampler}"
                assert passes <= len(reference)  # never more target passes than plain decoding


def test_speculation_saves_passes_and_hits_eos_inside_accepted_runs() -> None:
    """Make sure the equivalence above is not vacuous: drafts do get accepted."""
    target, draft = make_models(0)
    total_plain = total_spec = 0
    assert plain_greedy(target, PROMPTS[0])[-1] == EOS
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt)
        guess = ref + [0] * 10  # a perfect guess: everything accepted, EOS inside the accepted run
        out, passes, _ = speculative_greedy(target, None, prompt, 8, guess, use_sampler=False)
        assert out == ref
        assert passes == -(-len(ref) // 9)  # ceil(len / (k + 1))
        out, passes, _ = speculative_greedy(target, draft, prompt, 4, None, use_sampler=False)
        total_plain += len(ref)
        total_spec += passes
    assert total_spec < total_plain

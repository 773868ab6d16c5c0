"""The production loop, `orchestrator.loop.generate`, driven by in-process fakes.

The "models" are fixed random logit tables indexed by the last two tokens; the
draft is the target plus noise. `FakeService` stands in for a model service:
per-session caches with the services' contract (crop to cache_position, then
append; a cache_position beyond what it holds or a prefix_hash that does not
match what it holds is a cache miss), Score returning the last k + 1
positions, Propose drafting k tokens and feeding all but the last back. It
can be stopped (ServiceDown) or lose its caches (a restart). Sessions live in
an in-memory store with the Redis store's interface. Everything is injected
through LoopConfig (the router's `connect`), nothing is patched.

Covered here: greedy equivalence for every proposer kind and k in 0..8; the
sampled output's distribution (chi-square, with a draft that misreports q as
the control that must fail); KV bookkeeping (what each request resends,
multi-turn reuse, cache-miss recovery, draft failover and fallback, target
failover, abandoning a failed request).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from orchestrator.common.events import ChunkEvent
from orchestrator.round.loop import generate
from orchestrator.round import sessions
from orchestrator.fleet.remote import Call, ServiceDown
from orchestrator.fleet.routing import Router
from orchestrator.common.kinds import COMBINED, DRAFT, GUESS, LOOKUP, NONE
from orchestrator.config import LoopConfig
from orchestrator.common.request import TurnRequest
from orchestrator.common.stats import Tally, stats_to_proto
from specdec.core import rng
from specdec.core.fingerprint import fingerprint
from specdec.core.rng import Purpose
from specdec.core.sampling import SamplingParams, coupled_draws, probs_from_logits, sample, sampling_logits
from specdec.runtime.errors import CacheMiss, FailedPrecondition, InvalidArgument, Unavailable
from specdec.runtime.store import SessionRecord, StoreUnavailable
from specdec.v1 import common_pb2, model_pb2
from specdec.v1 import orchestrator_pb2 as pb
from specdec.runtime.wire import encode_probs, sampling_from_proto
from tests.chance import FALSE_ALARM

torch.set_num_threads(1)

VOCAB = 24
EOS = 3
MAX_NEW = 48
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [(1, 2, 5, 7, 1, 2), (9, 4, 11, 4, 9, 4, 11, 6, 9, 4)]


# --------------------------------------------------------------------- fakes


class TableModel:
    """next-token logits = table[prev2, prev1]; table is [vocab, vocab, vocab]."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def logits(self, prefix: list[int]) -> torch.Tensor:  # [vocab]
        return self.table[prefix[-2], prefix[-1]]

    def argmax(self, prefix: list[int]) -> int:
        return int(self.logits(prefix).argmax())


class FakeService:
    """A model service in-process: the ModelClient calls the loop makes, on a logit table."""

    def __init__(self, address: str, role: str, model: TableModel, *, misreport_q: bool = False) -> None:
        self.address, self.role, self.model = address, role, model
        self.caches: dict[str, list[int]] = {}
        self.requests: list[tuple[int, int, int]] = []  # (cache_position, len(tokens), k) per call
        self.down = False
        self.misreport_q = misreport_q  # control: report a uniform q instead of the one sampled from
        self.fail_after: int | None = None  # go down after this many more calls
        self.restart_at: int | None = None  # lose every cache (a restart) just before this call
        self.calls = 0
        self.left: list[str] = []  # sessions that said they make no more calls (leave)
        self.delay_s = 0.0  # per call, so a stream spans a store outage
        self.stale_noise = False  # control: the coupled sampler reuses position 0's noise everywhere

    def restart(self) -> None:
        self.caches.clear()

    def _feed(self, request) -> list[int]:
        self.calls += 1
        if self.calls == self.restart_at:
            self.restart()
        if self.fail_after is not None:
            self.fail_after -= 1
            self.down = self.fail_after < 0
        if self.down:
            raise ServiceDown(f"{self.role} service at {self.address} unavailable: UNAVAILABLE")
        cache = self.caches.get(request.session_id, [])
        n = request.cache_position
        if n > len(cache) or fingerprint(cache[:n]) != request.prefix_hash:
            raise CacheMiss(f"{self.role} {self.address}: prefix mismatch at {n}")
        cache = self.caches[request.session_id] = cache[:n] + list(request.tokens)
        self.requests.append((n, len(request.tokens), request.k))
        return cache

    @staticmethod
    def _call(request, response) -> Call:
        # Microseconds: well inside any real round, so the round's parts still add up.
        return Call(rpc_ms=0.003, server_ms=0.002, bytes_sent=request.ByteSize(),
                    bytes_received=response.ByteSize(), serialize_ms=0.0005)

    async def score(self, request: model_pb2.ScoreRequest):
        await asyncio.sleep(self.delay_s)
        cache = self._feed(request)
        n, k = len(cache), request.k
        logits = torch.stack([self.model.logits(cache[:j]) for j in range(n - k, n + 1)])  # [k + 1, vocab]
        response = model_pb2.ScoreResponse(argmax_ids=logits.argmax(-1).tolist(), cache_length=n)
        response.timing.total_ms = 0.002
        params = sampling_from_proto(request.sampling)
        if request.output_mode == common_pb2.OUTPUT_MODE_PROBS:
            response.probs.CopyFrom(encode_probs(probs_from_logits(logits, params)))
        if request.output_mode == common_pb2.OUTPUT_MODE_COUPLED:  # row j draws the token at index j
            response.sampled_ids.extend(_coupled(logits, params, request.seed, n - k, self.stale_noise))
        return response, self._call(request, response)

    async def propose(self, request: model_pb2.ProposeRequest):
        """Draft k tokens (argmax, or sampled with the DRAFT uniforms); feed all but the last."""
        await asyncio.sleep(self.delay_s)
        cache = self._feed(request)
        params = sampling_from_proto(request.sampling)
        drafted, q_rows = [], []
        for i in range(request.k):
            logits = self.model.logits(cache)
            if params.greedy:
                drafted.append(int(logits.argmax()))
            elif request.output_mode == common_pb2.OUTPUT_MODE_COUPLED:
                drafted += _coupled(logits[None], params, request.seed, len(cache), self.stale_noise)
            else:
                q = probs_from_logits(logits[None], params)  # [1, vocab]
                u = torch.tensor([rng.uniform(request.seed, len(cache), Purpose.DRAFT)], dtype=torch.float64)
                drafted.append(int(sample(q, u)[0]))
                q_rows.append(torch.full_like(q[0], 1 / VOCAB) if self.misreport_q else q[0])
            if i < request.k - 1:
                cache.append(drafted[-1])
        response = model_pb2.ProposeResponse(tokens=drafted, cache_length=len(cache))
        response.timing.total_ms = 0.002
        if q_rows:
            response.probs.CopyFrom(encode_probs(torch.stack(q_rows)))
        return response, self._call(request, response)

    def leave(self, session_id: str) -> None:  # ModelClient's: batch calls stop counting on it
        self.left.append(session_id)

    async def release(self, session_id: str) -> bool:
        if self.down:
            raise ServiceDown(f"{self.address} down")
        return self.caches.pop(session_id, None) is not None


def _coupled(logits: torch.Tensor, params: SamplingParams, seed: int, first: int,
             stale: bool = False) -> list[int]:
    """The coupled sampler's draws of rows predicting the tokens at indices first, first + 1, ...
    (`stale`, the control: every position draws with position 0's noise)."""
    positions = np.zeros(logits.shape[0], dtype=np.int64) if stale else np.arange(first, first + logits.shape[0])
    keys = rng.gumbel_keys(seed, positions)
    return coupled_draws(sampling_logits(logits, params), [int(key) for key in keys]).tolist()


class MemoryStore:
    """The session store's interface (specdec.runtime.store.SessionStore) over a dict."""

    def __init__(self) -> None:
        self.records: dict[str, SessionRecord] = {}

    async def load(self, session_id: str) -> SessionRecord | None:
        return self.records.get(session_id)

    async def save(self, record: SessionRecord) -> SessionRecord:
        now = time.time()
        record = replace(record, created=record.created or now, updated=now)
        self.records[record.session_id] = record
        return record

    async def delete(self, session_id: str) -> bool:
        return self.records.pop(session_id, None) is not None


class Tokenizer:
    """One letter per token id: enough for the incremental decoder and stop strings."""

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(ord("a") + i) for i in ids if not (skip_special_tokens and i == EOS))


class Stack:
    """Fake targets and drafts behind a real Router, a memory store, one LoopConfig."""

    def __init__(self, target: TableModel, draft: TableModel, *, targets: int = 1, drafts: int = 1,
                 misreport_q: bool = False, eos_ids: frozenset[int] = frozenset({EOS}), **config) -> None:
        self.services = {f"t{i}": FakeService(f"t{i}", "target", target) for i in range(targets)}
        self.services |= {f"d{i}": FakeService(f"d{i}", "draft", draft, misreport_q=misreport_q)
                          for i in range(drafts)}
        router = Router(None, {"target": [f"t{i}" for i in range(targets)],
                               "draft": [f"d{i}" for i in range(drafts)]},
                        connect=lambda address, role: self.services[address])
        self.store = MemoryStore()
        self.config = LoopConfig(store=self.store, router=router, tokenizer=Tokenizer(),
                                 eos_ids=eos_ids, context_length=4096, **config)

    def run(self, prompt, *, k: int = 4, proposer: str = DRAFT, sampling: SamplingParams = GREEDY,
            seed: int = 7, max_new: int = MAX_NEW, **spec) -> tuple[list[int], str, Tally]:
        """(new token ids, streamed text, tally) of one generate() call."""
        return asyncio.run(self.arun(prompt, k=k, proposer=proposer, sampling=sampling, seed=seed,
                                     max_new=max_new, **spec))

    async def arun(self, prompt, *, k, proposer, sampling, seed, max_new, **spec):
        spec = TurnRequest(prompt_ids=tuple(prompt), max_new_tokens=max_new, sampling=sampling, seed=seed,
                            proposer=proposer, k=k, **spec)
        ids, text, tally = [], "", None
        async for event in generate(spec, self.config):
            if isinstance(event, ChunkEvent):
                ids += event.token_ids
                text += event.text
            else:
                tally = event
        return ids, text, tally


def plain_greedy(model: TableModel, prompt, max_new: int = MAX_NEW) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        seq.append(model.argmax(seq))
        out.append(seq[-1])
        if seq[-1] == EOS:
            break
    return out


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


# --------------------------------------------------------------------- greedy equivalence


def assert_only_uncached_tokens_sent(stack: Stack, draft_skips_rounds: bool = False) -> None:
    """After each session's first request the target is sent one committed token (plus the
    drafts) and the draft one, or two after full acceptance (the catch-up token); a draft
    that sat out rounds (the combined proposer's lookup rounds) catches up on all of them."""
    for name, svc in stack.services.items():
        for position, n_tokens, k in svc.requests[1:]:
            if position == 0:
                continue  # a new session's prefill
            sent = n_tokens - k if svc.role == "target" else n_tokens
            if svc.role == "draft" and draft_skips_rounds:
                assert sent >= 1, (name, position, n_tokens, k)
            else:
                assert sent in ((1,) if svc.role == "target" else (1, 2)), (name, position, n_tokens, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", [DRAFT, LOOKUP, GUESS, NONE, COMBINED])
def test_speculative_greedy_equals_plain_greedy(seed: int, kind: str) -> None:
    target, draft = make_models(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    for prompt in PROMPTS:
        reference = plain_greedy(target, prompt)
        # A user guess: the true continuation with ~25% of tokens corrupted.
        guess = [t if torch.rand(1, generator=gen) > 0.25 else (t + 1) % VOCAB for t in reference] + [0] * 10
        for k in range(9):
            stack = Stack(target, draft, default_k=k)  # a request's k = 0 means the default
            out, text, tally = stack.run(prompt, k=k, proposer=kind, guess_ids=tuple(guess) if kind == GUESS else ())
            assert out == reference, f"k={k}"
            assert text == Tokenizer().decode(reference)
            assert tally.target_passes == len(tally.rounds) <= len(reference)  # never more passes than plain
            assert tally.cache_misses == 0  # every cache_position pointed at a prefix the service held
            assert tally.proposer == kind and not tally.fallback_reason
            assert_only_uncached_tokens_sent(stack, draft_skips_rounds=kind == COMBINED)
            if kind == NONE or k == 0:
                assert tally.drafted_tokens == 0 and all(r.k == 0 for r in tally.rounds)


def test_speculation_saves_passes_and_hits_eos_inside_accepted_runs() -> None:
    """Make sure the equivalence above is not vacuous: drafts do get accepted."""
    target, draft = make_models(0)
    total_plain = total_spec = 0
    assert plain_greedy(target, PROMPTS[0])[-1] == EOS
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt)
        # A perfect guess: everything accepted, EOS inside the accepted run.
        out, _, tally = Stack(target, draft).run(prompt, k=8, proposer=GUESS, guess_ids=tuple(ref + [0] * 10))
        assert out == ref
        assert tally.target_passes == -(-len(ref) // 9)  # ceil(len / (k + 1))
        out, _, tally = Stack(target, draft).run(prompt, k=4)
        assert out == ref and tally.accepted_tokens > 0 and tally.draft_calls > 0
        total_plain += len(ref)
        total_spec += tally.target_passes
    assert total_spec < total_plain


def test_adaptive_k_and_stop_strings() -> None:
    target, draft = make_models(1)
    ref = plain_greedy(target, PROMPTS[1])
    out, _, tally = Stack(target, draft, adaptive_k=True).run(PROMPTS[1], k=0)
    assert out == ref and tally.drafted_tokens > 0
    assert max(r.k for r in tally.rounds) > 1
    # A stop string: the output ends with the token that completes it; the text stops before it.
    text = Tokenizer().decode(ref)
    stop = text[10:12]
    out, streamed, tally = Stack(target, draft).run(PROMPTS[1], k=4, stop=(stop,))
    assert tally.finish_reason == "stop"
    assert out == ref[: len(out)] and stop in Tokenizer().decode(out) and stop not in Tokenizer().decode(out[:-1])
    assert streamed == text[: text.index(stop)]


def test_the_speculation_gate_scores_every_decoding_round_and_not_the_prefill() -> None:
    """A request that leaves k to the orchestrator feeds the replica's gate one record per round
    after its first (the prompt's prefill costs the same in either mode)."""
    target, draft = make_models(1)
    stack = Stack(target, draft, adaptive_k=True)
    out, _, tally = stack.run(PROMPTS[1], k=0)
    gate = stack.config.costs.gate("t0")
    assert out == plain_greedy(target, PROMPTS[1])
    assert tally.target_passes > 2 and gate.rounds == tally.target_passes - 1
    assert gate.live == 0  # the request left it
    _, _, fixed = stack.run(PROMPTS[0], k=3)  # a k in the request: not gated
    assert gate.rounds == tally.target_passes - 1 and fixed.target_passes > 0


@pytest.mark.parametrize("mode", ["plain", "plain-loaded", "drafting"])
def test_a_plain_epoch_takes_the_draft_model_away_but_keeps_a_lone_sessions_lookup_guesses(mode: str) -> None:
    """The gate's plain epoch means no draft model: the combined proposer makes no Propose call
    (nor the first round's feed). A lone session still proposes its free lookup guesses where they
    pay (the table model's next token depends on the last two, so a repeated bigram repeats what
    followed it); with another session live on the replica a plain epoch is target-only rounds.
    A drafting epoch (the control) calls the draft. Greedy text unchanged every time."""
    target, draft = make_models(0)
    stack = Stack(target, draft)
    gate = stack.config.costs.gate("t0")
    gate.epoch_s, gate.mode_spec = 3600.0, mode == "drafting"  # one epoch, in this mode, for the whole test
    if mode == "plain-loaded":
        gate.enter()  # another session on the replica
    prompt = PROMPTS[1]
    reference = plain_greedy(target, prompt, 40)
    out, _, tally = stack.run(prompt, k=0, proposer=COMBINED, max_new=40)
    assert out == reference and gate.mode_spec is (mode == "drafting")
    lookup_rounds = [r for r in tally.rounds if r.source == LOOKUP]
    proposes = len(stack.services["d0"].requests)
    if mode == "plain":
        assert proposes == 0 and tally.draft_calls == 0
        assert lookup_rounds and sum(r.accepted for r in lookup_rounds) > 0
        assert tally.target_passes < len(reference)  # the guesses saved passes
    elif mode == "plain-loaded":
        assert proposes == 0 and tally.drafted_tokens == 0 and tally.target_passes == len(reference)
    else:
        assert proposes > 0 and tally.draft_calls > 0


def test_a_first_round_streams_without_waiting_for_the_drafts_feed() -> None:
    """No k in the request: round 1 feeds the draft the prompt beside the target's Score
    (prefetch). A slow draft does not hold the first chunk back: the chunk goes once the Score is
    back, and the next Propose waits for the feed first, so no committed token reaches the draft
    twice. Greedy text unchanged.

    Counted in events, not seconds: every draft call is held until the first chunk has arrived,
    so a loop that waited for the feed before streaming would never stream it (the wait_for
    bound only ends such a hang)."""
    target, draft = make_models(2)
    stack = Stack(target, draft)
    drafts = stack.services["d0"]
    prompt = tuple(PROMPTS[1] * 3)  # 30 tokens: a prompt the draft lags by at least PREFETCH_MIN
    inner = drafts.propose

    async def first_chunk_and_all():
        first_chunk = asyncio.Event()

        async def held(request):  # the draft answers only once the first chunk is out
            await first_chunk.wait()
            return await inner(request)

        drafts.propose = held
        spec = TurnRequest(prompt_ids=prompt, max_new_tokens=8, sampling=GREEDY, seed=7,
                            proposer=DRAFT, k=0)
        ids, tally, answered_before = [], None, None
        async for event in generate(spec, stack.config):
            if isinstance(event, ChunkEvent):
                if answered_before is None:
                    answered_before = len(drafts.requests)
                    first_chunk.set()
                ids += event.token_ids
            else:
                tally = event
        return ids, tally, answered_before

    ids, tally, answered_before = asyncio.run(asyncio.wait_for(first_chunk_and_all(), 60))
    assert ids == plain_greedy(target, prompt, 8)
    assert answered_before == 0  # the first chunk came while the draft's feed was still held
    assert tally.rounds[0].drafted == 0 and tally.draft_calls > 0  # later rounds drafted
    fed_prompt, *later = drafts.requests
    assert fed_prompt == (0, len(prompt), 0)  # round 1: the prompt, drafting nothing
    assert later and all(position >= len(prompt) for position, _, _ in later)  # never resent


# --------------------------------------------------------------------- sampling exactness

S_VOCAB = 6
S_TRIALS = 4000
# Per check, for a fresh seed (tests.chance.FALSE_ALARM). The trials' seeds are fixed (1..trials):
# given the code each outcome is deterministic. With fresh seeds a correct sampler would fail one of
# this file's 6 checks (3 tests x first token and joint) with probability below 1e-5; the controls'
# joint statistics are 1,400 (misreported q) and 2,051 (stale noise) against a critical value of 90
# (35 degrees of freedom): they fail at any seed. test_parallel.py and test_translated.py use it too.
P_THRESHOLD = FALSE_ALARM


def sampling_models() -> tuple[TableModel, TableModel]:
    """A small vocabulary (so the joint of two tokens has few cells) and a draft far enough off
    that rejections, recovered tokens and bonus tokens all happen often."""
    gen = torch.Generator().manual_seed(11)
    table = torch.randn(S_VOCAB, S_VOCAB, S_VOCAB, generator=gen)
    return TableModel(table), TableModel(table + 1.0 * torch.randn(table.shape, generator=gen))


def first_two_tokens(misreport_q: bool, trials: int, proposer: str = DRAFT, prompt=(0, 1),
                     sources: set | None = None, coupled: bool = False,
                     stale_noise: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`trials` sampled generations (one seed each) of 3 tokens: round 1 drafts k = 2, then
    accepts 0, 1 or 2 of them and adds a recovered or bonus token. Returns the first two
    tokens [trials, 2] and how often round 1 accepted 0, 1, 2 drafted tokens [3]; `sources`
    collects what proposed each round (Round.source). The prompt must end in (0, 1)."""
    target, draft = sampling_models()
    stack = Stack(target, draft, misreport_q=misreport_q, eos_ids=frozenset())
    for service in stack.services.values():
        service.stale_noise = stale_noise
    params = SamplingParams(temperature=1.0)

    async def all_trials() -> tuple[list[list[int]], list[int]]:
        runs, accepted = [], []
        for seed in range(1, trials + 1):
            ids, _, tally = await stack.arun(prompt, k=4, proposer=proposer, sampling=params, seed=seed, max_new=3,
                                             coupled=coupled)
            runs.append(ids[:2])
            accepted.append(tally.accepted_per_round[0])
            if sources is not None:
                sources.update(r.source for r in tally.rounds)
        return runs, accepted

    runs, accepted = asyncio.run(all_trials())
    return np.array(runs), np.bincount(accepted, minlength=3)


def chain_pvalues(tokens: np.ndarray) -> tuple[float, float]:
    """Chi-square p-values of the first token and of the first two tokens against the target chain."""
    target, _ = sampling_models()
    params = SamplingParams(temperature=1.0)
    p1 = probs_from_logits(target.logits([0, 1])[None], params)[0].double().numpy()  # [vocab]
    p2 = np.stack([probs_from_logits(target.logits([1, t])[None], params)[0].double().numpy()
                   for t in range(S_VOCAB)])  # [vocab, vocab]: p(x2 | x1)
    first = np.bincount(tokens[:, 0], minlength=S_VOCAB)
    joint = np.bincount(tokens[:, 0] * S_VOCAB + tokens[:, 1], minlength=S_VOCAB**2)
    expected_joint = (p1[:, None] * p2).ravel()
    return (float(chisquare(first, p1 / p1.sum() * first.sum()).pvalue),
            float(chisquare(joint, expected_joint / expected_joint.sum() * joint.sum()).pvalue))


def test_sampled_output_has_the_target_distribution() -> None:
    tokens, accepted = first_two_tokens(misreport_q=False, trials=S_TRIALS)
    assert (accepted > S_TRIALS / 10).all()  # rejections, partial and full acceptance all happen often
    p_first, p_joint = chain_pvalues(tokens)
    print(f"\nloop exactness: first-token p={p_first:.4f}, two-token joint p={p_joint:.4f}")
    assert p_first > P_THRESHOLD and p_joint > P_THRESHOLD


def test_combined_proposer_mixing_lookup_and_draft_rounds_keeps_the_distribution() -> None:
    """Lookup rounds (one-hot q) and draft rounds (the draft's q) in one request: still exact."""
    sources: set[str] = set()
    tokens, _ = first_two_tokens(misreport_q=False, trials=S_TRIALS // 2, proposer=COMBINED,
                                 prompt=(0, 1, 2, 0, 1), sources=sources)
    assert {"lookup", "draft"} <= sources  # both kinds of round happened
    p_first, p_joint = chain_pvalues(tokens)
    print(f"\ncombined exactness: first-token p={p_first:.4f}, two-token joint p={p_joint:.4f}")
    assert p_first > P_THRESHOLD and p_joint > P_THRESHOLD


def test_a_draft_misreporting_q_fails_the_same_test() -> None:
    """The control: the same test has the power to catch a wrong accept/resample (q not the one sampled)."""
    p_first, p_joint = chain_pvalues(first_two_tokens(misreport_q=True, trials=S_TRIALS // 4)[0])
    print(f"\nmisreported q: first-token p={p_first:.2e}, two-token joint p={p_joint:.2e}")
    assert min(p_first, p_joint) < P_THRESHOLD


# --------------------------------------------------------------------- KV bookkeeping and failures


def test_record_and_service_caches_agree_with_the_committed_tokens() -> None:
    target, draft = make_models(2)
    stack = Stack(target, draft)
    out, _, tally = stack.run(PROMPTS[1], k=3, max_new=20, keep_session=True)
    record = stack.store.records[tally.session_id]
    assert list(record.tokens) == list(PROMPTS[1]) + out
    assert (record.target, record.draft) == ("t0", "d0") == (tally.target_replica, tally.draft_replica)
    for address, held in ((record.target, record.target_len), (record.draft, record.draft_len)):
        cache = stack.services[address].caches[tally.session_id]
        assert 0 < held <= len(cache) and cache[:held] == list(record.tokens[:held])
    assert held >= len(record.tokens) - 2  # the draft lacks at most the catch-up and the last token


def test_second_turn_reuses_the_kv_and_survives_a_restart() -> None:
    target, draft = make_models(0)
    stack = Stack(target, draft)
    first, _, t1 = stack.run(PROMPTS[0], k=4, max_new=10, keep_session=True)
    turn2 = PROMPTS[0] + tuple(first) + (4, 5)
    ref = plain_greedy(target, turn2, 12)
    out, _, t2 = stack.run(turn2, k=4, max_new=12, session_id=t1.session_id)
    assert out == ref and t2.session_id == t1.session_id
    assert t2.reused_prompt_tokens >= len(PROMPTS[0]) + len(first) - 1 and t2.cache_misses == 0
    # Both services restart (lose every cache): the third turn resends from 0, same text.
    stack.services["t0"].restart()
    stack.services["d0"].restart()
    turn3 = turn2 + tuple(out) + (6,)
    out3, _, t3 = stack.run(turn3, k=4, max_new=12, session_id=t1.session_id)
    assert out3 == plain_greedy(target, turn3, 12)
    assert t3.cache_misses == 2 == sum(r.cache_misses for r in t3.rounds)  # one per service, recovered


def test_draft_failover_moves_to_another_replica() -> None:
    target, draft = make_models(1)
    stack = Stack(target, draft, drafts=2)
    first, _, t1 = stack.run(PROMPTS[1], k=2, max_new=6, keep_session=True)
    home = t1.draft_replica  # the second turn starts there, and it dies after two calls
    other = ({"d0", "d1"} - {home}).pop()
    stack.services[home].fail_after = 2
    turn2 = PROMPTS[1] + tuple(first)
    out, _, t2 = stack.run(turn2, k=2, session_id=t1.session_id)
    assert out == plain_greedy(target, turn2)
    assert t2.proposer == DRAFT and not t2.fallback_reason
    assert t2.draft_replica == other == stack.store.records[t1.session_id].draft
    assert stack.services[other].requests[0][0] == 0  # the new replica was sent the session from 0
    assert t2.draft_calls == sum(r.k > 0 for r in t2.rounds)  # no round lost its proposal


def test_draft_down_falls_back_to_target_only_or_fails_when_strict() -> None:
    target, draft = make_models(1)
    ref = plain_greedy(target, PROMPTS[1])
    stack = Stack(target, draft)
    stack.services["d0"].fail_after = 2
    out, _, tally = stack.run(PROMPTS[1], k=3)
    assert out == ref
    assert tally.proposer == NONE and "draft service unavailable" in tally.fallback_reason
    assert tally.draft_calls == 2 and tally.rounds[-1].k == 0

    stack = Stack(target, draft)
    stack.services["d0"].fail_after = 2
    with pytest.raises(Unavailable, match="strict"):
        stack.run(PROMPTS[1], k=3, strict=True)
    # The failed single-turn request keeps its last committed state (for a resume; a short
    # TTL in Redis) and frees its KV on the target.
    (record,) = stack.store.records.values()
    assert list(record.tokens[: len(PROMPTS[1])]) == list(PROMPTS[1]) and not record.multi_turn
    assert not stack.services["t0"].caches


def test_no_draft_replica_at_all() -> None:
    target, draft = make_models(1)
    stack = Stack(target, draft, drafts=0)
    out, _, tally = stack.run(PROMPTS[0], k=3)
    assert out == plain_greedy(target, PROMPTS[0])
    assert tally.proposer == NONE and tally.fallback_reason == "no draft service replica available"
    with pytest.raises(Unavailable, match="strict"):
        stack.run(PROMPTS[0], k=3, strict=True)


def test_combined_goes_on_with_lookup_when_the_draft_dies_unless_strict() -> None:
    target, draft = make_models(1)
    ref = plain_greedy(target, PROMPTS[1])
    stack = Stack(target, draft)
    stack.services["d0"].fail_after = 1
    out, _, tally = stack.run(PROMPTS[1], k=3, proposer=COMBINED)
    assert out == ref
    assert tally.proposer == COMBINED and "draft service unavailable" in tally.fallback_reason
    sources = [r.source for r in tally.rounds]
    assert "lookup" in sources and sources.count("draft") <= 1  # the draft's one good call at most
    with pytest.raises(Unavailable, match="strict"):
        Stack(target, draft, drafts=0).run(PROMPTS[1], k=3, proposer=COMBINED, strict=True)
    stack = Stack(target, draft)
    stack.services["d0"].down = True
    with pytest.raises(Unavailable, match="strict"):
        stack.run(PROMPTS[1], k=3, proposer=COMBINED, strict=True)


def test_target_failover_resends_the_session_to_another_replica() -> None:
    target, draft = make_models(2)
    stack = Stack(target, draft, targets=2)
    first, _, t1 = stack.run(PROMPTS[0], k=2, max_new=6, keep_session=True)
    home = t1.target_replica
    other = ({"t0", "t1"} - {home}).pop()
    stack.services[home].fail_after = 3
    turn2 = PROMPTS[0] + tuple(first)
    out, _, t2 = stack.run(turn2, k=2, session_id=t1.session_id)
    assert out == plain_greedy(target, turn2)
    assert t2.target_replica == other == stack.store.records[t1.session_id].target
    assert stack.services[other].requests[0][0] == 0  # the new replica was sent the session from 0
    # With no replica left the request fails (after target_wait_s) and is abandoned.
    stack = Stack(target, draft, target_wait_s=0.0)
    stack.services["t0"].fail_after = 3
    with pytest.raises(ServiceDown):
        stack.run(PROMPTS[0], k=2)
    assert len(stack.store.records) == 1 and not stack.services["d0"].caches


# --------------------------------------------------------------------- stats


def test_every_stats_field_comes_from_the_tally() -> None:
    target, draft = make_models(0)
    _, _, tally = Stack(target, draft).run(PROMPTS[0], k=4, max_new=12)
    stats = stats_to_proto(tally)
    for name in pb.Stats.DESCRIPTOR.fields_by_name:
        if name != "rounds":
            assert getattr(stats, name) == pytest.approx(getattr(tally, name)), name
    assert len(stats.rounds) == tally.target_passes
    assert sum(r.committed for r in stats.rounds) == stats.new_tokens == 12
    assert stats.bytes_sent == sum(r.bytes_sent for r in stats.rounds) > 0
    for r in stats.rounds:
        parts = r.draft_ms + r.target_ms + r.serialize_ms + r.network_ms + r.orchestrator_ms + r.redis_ms
        assert parts == pytest.approx(r.total_ms, abs=1e-6)


def test_every_round_field_reaches_its_stats_round_set_or_unset() -> None:
    """Rounds are filled with their set fields only: each field, set or at its default, must read back."""
    from dataclasses import fields

    from orchestrator.common.stats import RoundTally
    tally = Tally()
    full = RoundTally()
    for i, f in enumerate(fields(RoundTally), start=1):
        value = {bool: True, str: "lookup", int: i, float: i + 0.5}.get(type(getattr(full, f.name)), [2, 0, 1])
        setattr(full, f.name, value)
    tally.rounds = [full, RoundTally()]
    stats = stats_to_proto(tally)
    for r, proto in zip(tally.rounds, stats.rounds):
        for name, value in r.as_dict().items():
            got = getattr(proto, name)
            assert (list(got) if name == "accepted_ranks" else got) == pytest.approx(value), name


# --------------------------------------------------------------------- Redis outages, failed turns, resume


class FlakyStore(MemoryStore):
    """A MemoryStore that can fail (Redis down) or hang (Redis frozen) for a while."""

    def __init__(self) -> None:
        super().__init__()
        self.down_until = 0.0  # monotonic: every call fails before this
        self.frozen_until = 0.0  # monotonic: every call waits until this, then succeeds
        self.held: asyncio.Event | None = None  # frozen until this event is set
        self.attempts = self.failures = 0

    def fail_for(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    async def _gate(self) -> None:
        self.attempts += 1
        if self.held is not None:
            await self.held.wait()
        if time.monotonic() < self.frozen_until:
            await asyncio.sleep(self.frozen_until - time.monotonic())
        if time.monotonic() < self.down_until:
            self.failures += 1
            raise StoreUnavailable("redis unavailable during session save: ConnectionError")

    async def load(self, session_id):
        await self._gate()
        return await super().load(session_id)

    async def save(self, record):
        await self._gate()
        return await super().save(record)

    async def delete(self, session_id):
        await self._gate()
        return await super().delete(session_id)


def flaky_stack(outage_s: float, **config) -> Stack:
    target, draft = make_models(0)
    stack = Stack(target, draft, redis_outage_s=outage_s, **config)
    stack.store = stack.config.store = FlakyStore()
    for service in stack.services.values():
        service.delay_s = 0.004  # ~10 ms a round: a 48-token stream spans the outages below
    return stack


async def _collect(stack: Stack, prompt, *, stop_after: int | None = None, **spec):
    """(chunks, tally or None, error or None) of one stream; stop_after chunks = a cancellation."""
    spec = TurnRequest(prompt_ids=tuple(prompt), max_new_tokens=spec.pop("max_new", MAX_NEW),
                        sampling=spec.pop("sampling", GREEDY), seed=spec.pop("seed", 7),
                        k=spec.pop("k", 4), **spec)
    chunks, tally, error = [], None, None
    stream = generate(spec, stack.config)
    try:
        async for event in stream:
            if isinstance(event, ChunkEvent):
                chunks.append(event)
                if stop_after is not None and len(chunks) == stop_after:
                    await stream.aclose()  # what a cancelled gRPC call does to the loop
                    break
            else:
                tally = event
    except Unavailable as exc:
        error = exc
    return chunks, tally, error


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_redis_outage_within_the_bound_is_invisible() -> None:
    """Writes fail for 0.15 s mid-stream (bound 0.3 s): the stream keeps going (same text),
    the states written during the outage coalesce, and the last state lands when Redis is back."""
    stack = flaky_stack(0.3)
    ref = plain_greedy(stack.services["t0"].model, PROMPTS[0])

    async def body():
        async def outage():
            await asyncio.sleep(0.03)
            stack.store.fail_for(0.15)
        asyncio.ensure_future(outage())
        return await _collect(stack, PROMPTS[0], keep_session=True)

    chunks, tally, error = asyncio.run(body())
    assert error is None and _ids(chunks) == ref
    assert stack.store.failures >= 2  # the outage was hit, and retried
    saves = stack.store.attempts - stack.store.failures
    assert saves < 1 + len(chunks)  # the session's opening + one per round, had nothing coalesced
    record = stack.store.records[tally.session_id]
    assert list(record.tokens) == list(PROMPTS[0]) + ref and record.multi_turn


def test_a_frozen_redis_within_the_bound_is_invisible() -> None:
    """Redis freezes after the first chunk: the rounds go on committing without their writes (the
    writes coalesce and land once it thaws), same text. Counted in chunks, not seconds: it thaws
    once 3 more chunks have come while frozen, or at the latest after 0.8 s (within the 1 s
    bound); rounds that waited for their writes would bring none in that time."""
    stack = flaky_stack(1.0)
    ref = plain_greedy(stack.services["t0"].model, PROMPTS[0])

    async def body():
        spec = TurnRequest(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW, sampling=GREEDY, seed=7, k=4,
                            keep_session=True)
        thaw = asyncio.Event()
        chunks, tally, while_frozen = [], None, 0
        async for event in generate(spec, stack.config):
            if not isinstance(event, ChunkEvent):
                tally = event
                continue
            chunks.append(event)
            if len(chunks) == 1:
                stack.store.held = thaw  # frozen: every store call waits
                asyncio.get_running_loop().call_later(0.8, thaw.set)
            elif not thaw.is_set():
                while_frozen += 1
                if while_frozen == 3:
                    thaw.set()
        return chunks, tally, while_frozen

    chunks, tally, while_frozen = asyncio.run(body())
    assert _ids(chunks) == ref
    assert list(stack.store.records[tally.session_id].tokens) == list(PROMPTS[0]) + ref
    assert while_frozen == 3  # the rounds did not wait out the freeze


def test_past_the_bound_the_stream_fails_and_the_prefix_is_saved_when_redis_returns() -> None:
    stack = flaky_stack(0.1)

    async def body():
        first, _, _ = await _collect(stack, PROMPTS[0], max_new=4, keep_session=True)
        sid = first[0].session_id
        turn2 = PROMPTS[0] + tuple(_ids(first))

        async def outage():
            await asyncio.sleep(0.03)
            stack.store.fail_for(1.2)
        asyncio.ensure_future(outage())
        chunks, tally, error = await _collect(stack, turn2, session_id=sid)
        during = stack.store.records[sid]
        # Redis is back 1.23 s in: the background writer lands the state (waited for, bounded).
        deadline = time.monotonic() + 10
        while (len(stack.store.records[sid].tokens) < len(turn2) + len(_ids(chunks))
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        return sid, turn2, chunks, tally, error, during

    sid, turn2, chunks, tally, error, during = asyncio.run(body())
    assert tally is None and error is not None and "redis" in str(error) and "redis://" not in str(error)
    assert error.code.name == "UNAVAILABLE"
    assert len(during.tokens) < len(turn2) + len(_ids(chunks))  # nothing landed in the outage
    record = stack.store.records[sid]
    assert list(record.tokens[: len(turn2) + len(_ids(chunks))]) == list(turn2) + _ids(chunks)
    # The next turn (a retry of this one) continues from it: the session survived.
    ref = plain_greedy(stack.services["t0"].model, turn2)
    out, _, t3 = stack.run(turn2, k=4, session_id=sid)
    assert out == ref and t3.reused_prompt_tokens >= len(turn2) - 1


def test_a_cancelled_or_failed_turn_keeps_the_session_and_a_retry_continues() -> None:
    stack = flaky_stack(1.0)
    model = stack.services["t0"].model

    async def body():
        first, t1, _ = await _collect(stack, PROMPTS[1], max_new=6, keep_session=True)
        turn2 = PROMPTS[1] + tuple(_ids(first)) + (4,)
        cut, _, _ = await _collect(stack, turn2, session_id=t1.session_id, stop_after=2)
        kept = stack.store.records[t1.session_id]
        # The draft dies and the request is strict: a failed turn, not a cancelled one.
        stack.services["d0"].fail_after = 1
        _, _, error = await _collect(stack, turn2, session_id=t1.session_id, strict=True)
        stack.services["d0"].fail_after, stack.services["d0"].down = None, False
        retry, t2, _ = await _collect(stack, turn2, session_id=t1.session_id)
        return t1, turn2, cut, kept, error, retry, t2

    t1, turn2, cut, kept, error, retry, t2 = asyncio.run(body())
    assert list(kept.tokens[: len(turn2) + len(_ids(cut))]) == list(turn2) + _ids(cut)
    assert kept.multi_turn and error is not None and "strict" in str(error)
    assert _ids(retry) == plain_greedy(model, turn2) and t2.session_id == t1.session_id
    assert t2.reused_prompt_tokens >= len(turn2) - 1  # the record and the KV were kept


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_k=8)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("send", [True, False], ids=["delivered", "from-record"])
def test_resume_streams_exactly_what_follows(sampling: SamplingParams, send: bool) -> None:
    """A stream cut after 2 chunks (its orchestrator gone), resumed from several indices with the
    tokens received (or, an older client, none: the record's stand for them), gives the uncut
    stream's tokens and text, contiguous; seed 0 is taken from the record. Sampled with the
    coupled sampler, the continuation is the same whatever the round boundaries were. Seed 0
    draws a random seed: sampled, ignore_eos keeps every draw long enough for the cut after 2
    chunks and the resumes after them (an early end token had cut 2 runs in 2,000 short)."""
    target, draft = make_models(1)
    stack = Stack(target, draft)
    coupled = not sampling.greedy

    async def body():
        # Kept, so that each resume below finds the record (a single-turn one is deleted when
        # its stream finishes, the first resume's here).
        cut, _, _ = await _collect(stack, PROMPTS[0], stop_after=2, sampling=sampling, seed=0,
                                   keep_session=True, coupled=coupled, ignore_eos=coupled)
        sid = cut[0].session_id
        record = stack.store.records[sid]
        assert record.turn_start == len(PROMPTS[0]) and record.turn_seed
        full, ref_tally, _ = await _collect(stack, PROMPTS[0], sampling=sampling, seed=record.turn_seed,
                                            coupled=coupled, ignore_eos=coupled)
        ends = [c.start_index + len(c.token_ids) for c in cut]
        whole = _ids(full)
        resumed = {}
        for n in (ends[0], ends[1], ends[1] + 1, len(PROMPTS[0]) + ref_tally.new_tokens):
            delivered = tuple(whole[: n - len(PROMPTS[0])]) if send else None
            if not send:  # the record must hold them: what the cut stream and earlier resumes saved
                stack.store.records[sid] = replace(stack.store.records[sid],
                                                   tokens=tuple(PROMPTS[0]) + tuple(whole))
            resumed[n] = await _collect(stack, PROMPTS[0], sampling=sampling, seed=0, session_id=sid,
                                        resume_from=n, delivered=delivered, coupled=coupled, ignore_eos=coupled)
        assert stack.store.records[sid].turn_seed == record.turn_seed
        return cut, full, resumed

    cut, full, resumed = asyncio.run(body())
    assert cut[0].start_index == len(PROMPTS[0]) and cut[1].start_index == cut[0].start_index + len(cut[0].token_ids)
    assert _ids(full)[: len(_ids(cut))] == _ids(cut)
    whole_ids, whole_text = _ids(full), "".join(c.text for c in full)
    decoder = Tokenizer()
    for n, (chunks, tally, error) in resumed.items():
        assert error is None and tally is not None
        have = whole_ids[: n - len(PROMPTS[0])]
        assert have + _ids(chunks) == whole_ids, n
        index = n
        for c in chunks:
            assert c.start_index == index
            index += len(c.token_ids)
        assert decoder.decode(have) + "".join(c.text for c in chunks) == whole_text
    last = resumed[len(PROMPTS[0]) + len(whole_ids)]
    finish = "length" if coupled else full_finish(full, whole_ids)  # (sampled: ignore_eos)
    assert last[0] == [] and last[1].finish_reason == finish  # stats only


def full_finish(chunks, ids) -> str:
    return "eos" if ids and ids[-1] == EOS else "length"


def test_a_resume_continues_from_the_delivered_tokens_not_from_the_turns_start() -> None:
    """Rejection sampling (no coupling): the resumed rounds draft and score after exactly the
    delivered tokens, even tokens this turn's own rounds would not have drawn. Seed 0 draws a
    random seed (secrets), so the text is left to chance: ignore_eos makes its length not."""
    target, draft = make_models(1)
    stack = Stack(target, draft)
    sampled = SamplingParams(temperature=1.0)
    prompt = PROMPTS[1]
    delivered = (5, 6, 7)  # not what the turn drew: any tokens the client holds are the prefix

    async def body():
        return await _collect(stack, prompt, sampling=sampled, seed=0, session_id="s1", ignore_eos=True,
                              resume_from=len(prompt) + len(delivered), delivered=delivered, max_new=12)

    chunks, tally, error = asyncio.run(body())
    assert error is None and chunks[0].start_index == len(prompt) + len(delivered)
    scored = [r for r in stack.services["t0"].requests]
    assert scored[0][0] + scored[0][1] - scored[0][2] == len(prompt) + len(delivered)  # prefix = prompt + delivered
    assert tally.new_tokens == 12 and len(_ids(chunks)) == 12 - len(delivered)


def test_resume_errors() -> None:
    target, draft = make_models(1)
    stack = Stack(target, draft)
    plain = plain_greedy(target, PROMPTS[0])
    with pytest.raises(InvalidArgument, match="resume_from"):
        stack.run(PROMPTS[0], resume_from=2, session_id="x")
    # An older client sends no delivered tokens: with no record of them, it is told to send them.
    with pytest.raises(FailedPrecondition, match="delivered"):
        stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 1, session_id="gone",
                  sampling=SamplingParams(temperature=1.0), seed=0)
    # With them, a resume whose record is gone continues from them (any seed samples exactly).
    out, _, tally = stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 3, session_id="gone",
                              delivered=tuple(plain[:3]))
    assert out == plain[3:] and tally.new_tokens == len(plain)
    # seed 0 draws a random seed (secrets, not torch's generator): only what holds for every draw
    # is asserted, so a sample may end on EOS before the length limit (the CI machine drew one).
    out, _, tally = stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 2, session_id="gone2",
                              delivered=tuple(plain[:2]), sampling=SamplingParams(temperature=1.0), seed=0)
    assert tally.new_tokens == 2 + len(out)
    assert len(out) == MAX_NEW - 2 or (out[-1] == EOS and tally.finish_reason == "eos"), out
    # Tokens that disagree with the turn's record are refused.
    _, _, kept = stack.run(PROMPTS[0], keep_session=True, max_new=6)
    wrong = tuple((t + 1) % VOCAB for t in plain[:4])
    with pytest.raises(FailedPrecondition, match="differ"):
        stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 4, session_id=kept.session_id, delivered=wrong)
    # Delivered tokens that end the turn: nothing left to generate, the stats only.
    eos_at = (4, 4, EOS)
    out, _, tally = stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 3, session_id="ended",
                              delivered=eos_at)
    assert out == [] and tally.finish_reason == "eos" and tally.target_passes == 0
    with pytest.raises(InvalidArgument, match="after the end"):
        stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 4, session_id="ended2", delivered=(EOS, 4, 4, 4))
    out, _, tally = stack.run(PROMPTS[0], resume_from=len(PROMPTS[0]) + 2, session_id="stopped",
                              delivered=(4, 5), stop=("ef",))
    assert out == [] and tally.finish_reason == "stop"


# --------------------------------------------------------------------- one seed, one text


def test_a_seed_means_one_text_whatever_proposes_at_any_k() -> None:
    """The coupled sampler: for each seed, target-only decoding and every proposer at every k
    commit the same tokens, while the drafts are accepted often."""
    target, draft = make_models(3)
    stack = Stack(target, draft)
    sampled = SamplingParams(temperature=0.8)
    accepted = drafted = 0  # of the draft at k = 1: the coupling's agreement
    for seed in range(1, 21):
        prompt = PROMPTS[seed % 2]
        want, _, _ = stack.run(prompt, k=0, proposer=NONE, sampling=sampled, seed=seed, coupled=True)
        for proposer, k in ((DRAFT, 1), (DRAFT, 4), (DRAFT, 8), (LOOKUP, 4), (COMBINED, 5)):
            got, _, tally = stack.run(prompt, k=k, proposer=proposer, sampling=sampled, seed=seed, coupled=True)
            assert got == want, (seed, proposer, k)
            if (proposer, k) == (DRAFT, 1):
                accepted += tally.accepted_tokens
                drafted += tally.drafted_tokens
    # The draft draws with the target's noise: it agrees about as often as rejection sampling
    # accepts (0.74 with these tables), far above independent draws.
    assert drafted and accepted / drafted > 0.5, (accepted, drafted)


def test_the_coupled_sampler_has_the_target_distribution() -> None:
    tokens, accepted = first_two_tokens(misreport_q=False, trials=S_TRIALS, coupled=True)
    assert (accepted > S_TRIALS / 20).all()  # rejections, partial and full acceptance all happen
    p_first, p_joint = chain_pvalues(tokens)
    print(f"\ncoupled exactness: first-token p={p_first:.4f}, two-token joint p={p_joint:.4f}")
    assert p_first > P_THRESHOLD and p_joint > P_THRESHOLD


def test_a_coupled_sampler_reusing_one_positions_noise_fails_the_same_test() -> None:
    """The control: noise shared between positions (a wrong sampler) correlates the two tokens."""
    tokens, _ = first_two_tokens(misreport_q=False, trials=S_TRIALS // 2, coupled=True, stale_noise=True)
    p_first, p_joint = chain_pvalues(tokens)
    print(f"\nstale noise: first-token p={p_first:.2e}, two-token joint p={p_joint:.2e}")
    assert p_joint < P_THRESHOLD


def test_single_turn_requests_leave_no_record_and_no_kv() -> None:
    target, draft = make_models(0)
    stack = Stack(target, draft)
    for prompt in PROMPTS:
        _, _, tally = stack.run(prompt, k=3, max_new=8)
        assert tally.session_id == ""
    assert not stack.store.records
    assert not any(svc.caches for svc in stack.services.values())
    _, _, tally = stack.run(PROMPTS[0], k=3, max_new=8, keep_session=True)
    assert list(stack.store.records) == [tally.session_id] and stack.store.records[tally.session_id].multi_turn

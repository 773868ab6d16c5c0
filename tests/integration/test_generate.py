"""Generate end to end (target + draft + orchestrator processes, real Redis, the client library).

Greedy equality is the central promise: every proposer, at every k, gives
token-for-token the target-only output, which itself equals plain
transformers greedy `generate`.
"""
from __future__ import annotations

import collections
import time

import pytest
import torch

PROMPTS = [
    "The cat sat on the",
    "Please rewrite the following sentence: the cat sat on the mat and purred.",
    "def add(a, b):\n    return",
    "mat is",  # the tiny target repeats itself here: lookup and a text guess both hit
]
N_NEW = 32


@pytest.fixture(scope="module")
def references(client):
    """Target-only greedy output per prompt (the baseline every proposer must match)."""
    return {p: client.complete(p, max_new_tokens=N_NEW, proposer="none") for p in PROMPTS}


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


def test_target_only_equals_transformers_generate(references, tiny_pair, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    for prompt, ref in references.items():
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW,
                             pad_token_id=tokenizer.pad_token_id)
        assert list(ref.token_ids) == out[0, ids.shape[1]:].tolist(), prompt
        assert ref.stats.target_passes == N_NEW  # target-only: one pass per token


@pytest.mark.parametrize("proposer", ["draft", "lookup", "suffix", "guess", "combined"])
def test_greedy_equality_every_proposer_every_k(client, references, tokenizer, proposer):
    for prompt, ref in references.items():
        ref_ids = list(ref.token_ids)
        # A guess that is right for a while, then wrong: both paths get exercised.
        guess = tokenizer.decode(ref_ids[:12]) + " wrong turn here"
        for k in range(1, 9):
            out = client.complete(prompt, max_new_tokens=N_NEW, proposer=proposer, k=k,
                                  guess=guess if proposer == "guess" else "")
            assert list(out.token_ids) == ref_ids, (proposer, k, prompt)
            assert out.text == ref.text
            assert out.stats.proposer == proposer and not out.stats.fallback_reason
            assert out.stats.target_passes <= N_NEW
            assert sum(out.stats.accepted_per_round) == out.stats.accepted_tokens
            assert out.stats.new_tokens == N_NEW
            assert out.stats.target_passes == len(out.stats.accepted_per_round)
            assert out.stats.accepted_tokens + out.stats.target_passes == N_NEW
            sources = {r.source for r in out.stats.rounds}
            assert sources <= ({"", "draft", "lookup", "suffix"} if proposer == "combined" else {"", proposer})


def test_speculation_saves_target_passes(client, references, tokenizer):
    prompt = PROMPTS[3]
    out = client.complete(prompt, max_new_tokens=N_NEW, proposer="draft", k=4)
    assert out.stats.target_passes < N_NEW
    # The last round has room for one token only: no draft call then.
    assert out.stats.target_passes - 1 <= out.stats.draft_calls <= out.stats.target_passes
    assert 0 < out.stats.acceptance_rate <= 1
    ref_ids = list(references[prompt].token_ids)
    guess = tokenizer.decode(ref_ids[:24])
    # How many leading tokens of the guess, tokenized on its own, are the target's.
    agree = 0
    for a, b in zip(tokenizer.encode(guess, add_special_tokens=False), ref_ids):
        if a != b:
            break
        agree += 1
    assert agree >= 8, "the tiny target's output should round-trip through text here"
    full = client.complete(prompt, max_new_tokens=N_NEW, proposer="guess", k=8, guess=guess)
    assert list(full.token_ids) == ref_ids
    assert full.stats.accepted_tokens >= agree - (agree + 8) // 9
    assert full.stats.target_passes <= (agree + 8) // 9 + 1 + (N_NEW - agree)
    assert full.stats.acceptance_by_position[0] == 1.0


def test_stats_account_time_and_bytes(client):
    out = client.complete(PROMPTS[1], max_new_tokens=16, proposer="draft", k=3)
    s = out.stats
    assert not s.session_id  # single-turn: nothing to continue
    assert s.finish_reason == "length" and s.seed != 0
    assert s.prompt_tokens > 0 and s.new_tokens == 16
    assert s.bytes_sent > 0 and s.bytes_received > 0
    assert s.draft_ms > 0 and s.target_ms > 0 and s.network_ms > 0 and s.redis_ms > 0
    assert s.orchestrator_ms > 0 and s.ttft_ms > 0 and s.overhead_p50_ms > 0
    parts = s.draft_ms + s.target_ms + s.network_ms + s.redis_ms + s.orchestrator_ms
    assert parts <= s.total_ms * 1.01 + 1.0
    assert s.target_replica and s.draft_replica
    assert len(s.acceptance_by_position) == 3


def test_streaming_order_and_content(client, tokenizer):
    stream = client.generate(PROMPTS[0], max_new_tokens=400, proposer="none", ignore_eos=True)
    started = time.perf_counter()
    arrivals, chunks = [], []
    for chunk in stream:
        arrivals.append(time.perf_counter() - started)
        chunks.append(chunk)
    stats = stream.stats
    assert stats is not None and stats.new_tokens == 400
    assert all(c.token_ids for c in chunks)  # every round commits >= 1 token
    assert len(chunks) == stats.target_passes  # one message per round, never merged
    ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True)
    # Streamed, not buffered: the first chunk arrives long before the last. A clock, but with room:
    # buffered, both arrive together; streamed, the first comes one pass in, and only a client
    # stalled at it for half of the 400 passes (over a second here) would fail this.
    assert arrivals[0] < 0.5 * arrivals[-1]


@pytest.mark.parametrize("proposer,k", [("none", 0), ("draft", 4), ("lookup", 8)])
def test_max_new_tokens_exact(client, proposer, k):
    for n in (1, 2, 3, 7, 17):
        out = client.complete(PROMPTS[1], max_new_tokens=n, proposer=proposer, k=k)
        assert len(out.token_ids) == n and out.stats.new_tokens == n
        assert out.stats.finish_reason == "length"


def test_stop_strings_never_leak(client, references):
    prompt = PROMPTS[0]
    ref = references[prompt]
    # Stop strings taken from the reference text at several places (printable only).
    candidates = [ref.text[i : i + 2] for i in range(3, len(ref.text) - 2, 5)]
    candidates = [c for c in candidates if c.isprintable() and "\ufffd" not in c][:4]
    assert candidates
    for stop in candidates:
        for proposer, k in (("none", 0), ("draft", 5), ("guess", 8)):
            stream = client.generate(prompt, max_new_tokens=N_NEW, proposer=proposer, k=k,
                                     stop=[stop, "never-appears"], guess=ref.text)
            chunks = list(stream)
            text = "".join(c.text for c in chunks)
            assert text == ref.text[: ref.text.index(stop)], (stop, proposer)
            assert stop not in text
            assert stream.stats.finish_reason == "stop"
            ids = [t for c in chunks for t in c.token_ids]
            # Token ids stop at the token that completed the stop string.
            assert ids == list(ref.token_ids[: len(ids)])
            assert len(ids) < N_NEW


def test_chat_messages_use_the_chat_template(client, tokenizer):
    messages = [{"role": "user", "content": "Say something about cats."}]
    out = client.complete(messages=messages, max_new_tokens=8, proposer="none")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.stats.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    same = client.complete(rendered, max_new_tokens=8, proposer="none")
    assert same.token_ids == out.token_ids


def test_check_predicts_every_position_in_one_pass(client, references, tokenizer):
    prompt = PROMPTS[3]
    ref_ids = list(references[prompt].token_ids)
    right = client.check(prompt, tokenizer.decode(ref_ids[:8]))
    assert right.first_mismatch == -1 and right.accepted == len(right.positions) == 8
    assert [p.predicted_id for p in right.positions] == ref_ids[:8]
    assert all(0 < p.predicted_prob <= 1 and p.guess_prob == p.predicted_prob for p in right.positions)
    assert right.next_id == ref_ids[8]
    wrong = client.check(prompt, tokenizer.decode(ref_ids[:5]) + " zebra")
    assert wrong.first_mismatch == wrong.accepted == 5
    mismatch = wrong.positions[5]
    assert mismatch.guess_id != mismatch.predicted_id
    assert mismatch.predicted_id == ref_ids[5]  # what the target really writes there
    assert mismatch.guess_prob < mismatch.predicted_prob
    assert wrong.target_text_at_mismatch == mismatch.predicted_text
    assert wrong.accepted_text == tokenizer.decode(ref_ids[:5])


def test_end_session_forgets_it(client):
    out = client.complete(PROMPTS[0], max_new_tokens=4, keep_session=True)
    sid = out.stats.session_id
    assert client.end_session(sid) is True
    assert client.end_session(sid) is False


def test_async_client_twin(stack):
    import asyncio

    from client import AsyncClient

    async def body():
        async with AsyncClient(stack.addresses["orch"]) as c:
            chunks = [ch async for ch in c.generate(PROMPTS[0], max_new_tokens=10, proposer="draft")]
            done = await c.complete(PROMPTS[0], max_new_tokens=10, proposer="none")
            return chunks, done

    chunks, done = asyncio.run(body())
    assert [t for c in chunks for t in c.token_ids] == list(done.token_ids)
    assert done.stats.new_tokens == 10


def test_prometheus_metrics_count_generations(client, stack):
    import urllib.request

    def scrape() -> str:
        url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=5).read().decode()

    def value(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    before = scrape()
    client.complete(PROMPTS[0], max_new_tokens=9, proposer="lookup")
    after = scrape()
    assert value(after, "specdec_generated_tokens_total") - value(before, "specdec_generated_tokens_total") == 9
    assert value(after, "specdec_generations_total") == value(before, "specdec_generations_total") + 1
    assert 'specdec_requests_total{code="OK",method="/specdec.v1.Orchestrator/Generate"}' in after


def test_adaptive_k_stays_exact(stack, tiny_pair, references):
    from client import Client

    address = stack.start_orchestrator("orch-auto", tiny_pair[0], extra=("--default-k", "auto"))
    try:
        with Client(address) as c:
            drafted = 0
            for prompt, ref in references.items():
                out = c.complete(prompt, max_new_tokens=N_NEW, proposer="draft")  # k = 0: adaptive
                assert out.token_ids == ref.token_ids
                assert all(0 <= d <= 16 for d in out.stats.drafted_per_round)
                drafted += out.stats.drafted_tokens
            # Goodput k may choose 0 in some rounds (drafting must pay), but it
            # drafts at first on a new replica (prior) and keeps probing.
            assert drafted > 0
    finally:
        stack.stop_one("orch-auto")


def test_fixed_k_drafts_k_per_round(client):
    out = client.complete(PROMPTS[0], max_new_tokens=N_NEW, proposer="draft", k=3)
    left = N_NEW
    for drafted, accepted in zip(out.stats.drafted_per_round, out.stats.accepted_per_round):
        assert drafted == min(3, left - 1)
        left -= accepted + 1


@pytest.mark.parametrize("proposer", ["lookup", "guess"])
def test_sampled_deterministic_proposals_give_the_target_only_text(client, references, tokenizer, proposer):
    """A deterministic proposal (q one-hot) is verified by coupling with target-only's own
    draws: the sampled text is token for token the target-only one for the same seed."""
    for seed in (3, 11, 12345):
        for prompt, ref in references.items():
            plain = client.complete(prompt, max_new_tokens=N_NEW, proposer="none", temperature=0.9,
                                    top_k=40, seed=seed)
            guess = tokenizer.decode(list(ref.token_ids)[:16])
            out = client.complete(prompt, max_new_tokens=N_NEW, proposer=proposer, k=4, temperature=0.9,
                                  top_k=40, seed=seed, guess=guess if proposer == "guess" else "")
            assert out.token_ids == plain.token_ids, (proposer, seed, prompt)
            assert out.stats.target_passes <= plain.stats.target_passes


def _prompt_reaching_eos(tiny_pair, tokenizer) -> tuple[str, list[int]]:
    """A prompt whose greedy continuation by the tiny target holds its EOS within N_NEW tokens, and
    that continuation (N_NEW tokens, not stopped at EOS): random prompts (decoded and re-encoded,
    as the orchestrator encodes them), searched in one batched generate, then checked alone."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop: the continuation past EOS
    texts = [tokenizer.decode(row) for row in torch.randint(3, len(tokenizer), (4096, 5)).tolist()]
    encoded = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    width = collections.Counter(len(ids) for ids in encoded).most_common(1)[0][0]
    same = [(t, ids) for t, ids in zip(texts, encoded) if len(ids) == width][:2048]  # one unpadded batch

    def greedy(rows: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            out = model.generate(torch.tensor(rows), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        return out[:, width:]

    found = greedy([ids for _, ids in same])
    for (text, ids), row in zip(same, found):
        if tokenizer.eos_token_id in row.tolist():
            alone = greedy([ids])[0].tolist()
            if tokenizer.eos_token_id in alone[:-1]:  # tokens after it: ignore_eos makes a difference
                return text, alone
    raise AssertionError("no random prompt leads the tiny target to EOS")


def test_ignore_eos_generates_exactly_max_new_tokens(client, tiny_pair, tokenizer):
    import grpc

    prompt, continuation = _prompt_reaching_eos(tiny_pair, tokenizer)
    at = continuation.index(tokenizer.eos_token_id)
    stopped = client.complete(prompt, max_new_tokens=N_NEW, proposer="none")
    assert list(stopped.token_ids) == continuation[:at + 1] and stopped.stats.finish_reason == "eos"
    for proposer, k in (("none", 0), ("draft", 4), ("lookup", 3), ("combined", 0)):  # greedy: the same tokens
        out = client.complete(prompt, max_new_tokens=N_NEW, proposer=proposer, k=k, ignore_eos=True)
        assert list(out.token_ids) == continuation, proposer
        assert out.stats.finish_reason == "length" and out.stats.new_tokens == N_NEW
    with pytest.raises(grpc.RpcError) as err:
        client.complete(prompt, max_new_tokens=4, ignore_eos=True, regex="[ab]+")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ignore_eos" in err.value.details()


def test_a_stream_interval_joins_chunks_and_keeps_the_text(stack, tiny_pair, references):
    from client import Client

    address = stack.start_orchestrator("orch-interval", tiny_pair[0], extra=("--stream-interval", "4"))
    try:
        with Client(address) as c:
            for prompt, ref in references.items():
                for proposer, k in (("none", 0), ("draft", 3)):
                    stream = c.generate(prompt, max_new_tokens=N_NEW, proposer=proposer, k=k)
                    chunks = list(stream)
                    assert [t for ch in chunks for t in ch.token_ids] == list(ref.token_ids), (prompt, proposer)
                    assert "".join(ch.text for ch in chunks) == ref.text
                    # The first chunk at once; every other but the last holds 4 tokens or more.
                    assert all(len(ch.token_ids) >= 4 for ch in chunks[1:-1]), [len(ch.token_ids) for ch in chunks]
                    if proposer == "none":  # a token a round: the first, then fours, then the rest
                        assert len(chunks) == 1 + -(-(len(ref.token_ids) - 1) // 4)
                    starts = [ch.start_index for ch in chunks]
                    assert starts == [chunks[0].start_index + sum(len(ch.token_ids) for ch in chunks[:i])
                                      for i in range(len(chunks))]
    finally:
        stack.stop_one("orch-interval")

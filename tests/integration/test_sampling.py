"""Sampling is exact end to end, whatever the draft, for both samplers.

With a deliberately mismatched tiny draft, the first two generated tokens over
many seeds must follow the target's own joint distribution, computed directly
with transformers (top-k 4 at temperature 1 keeps the support at 16 pairs).
Seeded requests use the coupled sampler (specdec.core.verify); an orchestrator
started with `--sampler rejection` verifies the same seeds by rejection
sampling, and one with the default configuration (default proposer, gate,
`--default-k auto`) must pass too.

Test: Pearson chi-square of the observed joint counts against the target's
joint, cells with expected count < 5 pooled. Pass when p > P_THRESHOLD
(tests.chance.FALSE_ALARM = 1e-6). Power check: the same counts against the
draft's own joint distribution must be rejected (p < P_THRESHOLD), so the test
can tell the two apart at this sample size.

Chance: seeds 1..1,200 are fixed, and seeded requests are sampled by counter-based
noise (a function of the seed and the position, whatever the batch or the
concurrency), so given the code the counts and p-values are the same on every
run. With fresh seeds a correct sampler would fail each test's one check with
probability 1e-6 (5 checks here, 2 more in test_feature_draft.py). The power
checks' statistics are above 31,000 against critical values of 53 to 58 (13 to
16 degrees of freedom; the constrained ones, and test_feature_draft.py's, see
pairs the rejected joint makes impossible): they fail at any seed.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.stats import chisquare

from client import Client
from tests.chance import FALSE_ALARM
from tests.integration.stack import Stack

PROMPT = "The capital of France is"
TOP_K = 4
SEEDS = 1200
P_THRESHOLD = FALSE_ALARM  # per check, for fresh seeds (the seeds here are fixed)


@pytest.fixture(scope="module")
def mismatched(tiny_pair, tmp_path_factory):
    from tests.tiny import build_model

    target_dir, _ = tiny_pair
    root = tmp_path_factory.mktemp("mismatched")
    torch.set_num_threads(1)
    draft_dir = build_model(root / "draft", seed=7, perturb_from=target_dir, perturb_std=0.06)
    s = Stack(logs=root)
    try:
        t = s.start_service("target", "target", target_dir, register=False)
        d = s.start_service("draft", "draft", draft_dir, register=False)
        # 1200 back-to-back calls: faster than the default per-tenant rate on a quick machine.
        s.start_orchestrator("orch", target_dir, targets=[t], drafts=[d],
                             extra=("--rate-per-tenant", "0"))
        s.start_orchestrator("orch-rejection", target_dir, targets=[t], drafts=[d],
                             extra=("--rate-per-tenant", "0", "--sampler", "rejection"))
        s.start_orchestrator("orch-default", target_dir, targets=[t], drafts=[d],
                             extra=("--rate-per-tenant", "0", "--default-k", "auto"))
        yield s, target_dir, draft_dir
    finally:
        s.stop()


def joint(model_dir, prompt_ids: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) of a model under temperature 1 + top-k, computed directly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def dist(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, TOP_K)
        probs = torch.softmax(top.values.double(), dim=-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    out = {}
    for t1, p1 in dist(prompt_ids).items():
        for t2, p2 in dist(prompt_ids + [t1]).items():
            out[(t1, t2)] = p1 * p2
    return out


def chi2_pvalue(counts: dict, expected_p: dict, n: int) -> float:
    cells = sorted(expected_p, key=lambda c: -expected_p[c])
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for c in cells:
        e = expected_p[c] * n
        if e >= 5:
            obs.append(counts.get(c, 0))
            exp.append(e)
        else:
            pooled_o += counts.get(c, 0)
            pooled_e += e
    unexpected = sum(v for c, v in counts.items() if c not in expected_p)
    pooled_o += unexpected
    pooled_e = max(pooled_e, 1e-9)  # an impossible pair makes the statistic explode
    obs.append(pooled_o)
    exp.append(pooled_e)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


WORKERS = 4  # concurrent streams: the services batch them, and the counts do not depend on the order
PAIR_OPTIONS = dict(max_new_tokens=3, temperature=1.0, top_k=TOP_K, proposer="draft", k=2)


def first_pairs(address: str, seeds: int = SEEDS, check=None,
                **options) -> tuple[dict[tuple[int, int], int], int, int]:
    """Counts of the first two sampled tokens over `seeds` seeds (draft k = 2 unless `options`
    say otherwise), and the drafted and accepted totals. WORKERS streams run at once, each
    through its own client; `check(seed, completion)` sees every completion."""
    options = {**PAIR_OPTIONS, **options}

    def run(worker: int) -> list[tuple[tuple[int, int], int, int]]:
        rows = []
        with Client(address, timeout=120) as client:
            for seed in range(1 + worker, seeds + 1, WORKERS):
                out = client.complete(PROMPT, seed=seed, **options)
                if check is not None:
                    check(seed, out)
                rows.append((tuple(out.token_ids[:2]), out.stats.drafted_tokens, out.stats.accepted_tokens))
        return rows

    counts: dict[tuple[int, int], int] = {}
    drafted = accepted = 0
    with ThreadPoolExecutor(WORKERS) as pool:
        for rows in pool.map(run, range(WORKERS)):
            for pair, d, a in rows:
                counts[pair] = counts.get(pair, 0) + 1
                drafted += d
                accepted += a
    assert sum(counts.values()) == seeds
    return counts, drafted, accepted


def _is_seeded_draft(seed, out) -> None:
    assert out.stats.seed == seed and out.stats.proposer == "draft"


@pytest.mark.parametrize("orch", ["orch", "orch-rejection"], ids=["coupled", "rejection"])
def test_first_two_tokens_follow_the_target_distribution(mismatched, orch):
    from transformers import AutoTokenizer

    stack, target_dir, draft_dir = mismatched
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    counts, drafted, accepted = first_pairs(stack.addresses[orch], check=_is_seeded_draft)
    with Client(stack.addresses[orch]) as c:
        again = c.complete(PROMPT, seed=5, **PAIR_OPTIONS)
        first = c.complete(PROMPT, seed=5, **PAIR_OPTIONS)
    assert again.token_ids == first.token_ids  # same seed, same text
    target_p = joint(target_dir, prompt_ids)
    draft_p = joint(draft_dir, prompt_ids)
    rate = accepted / drafted
    assert 0.05 < rate < 0.9, f"the draft should be wrong often enough to test rejections ({rate:.2f})"
    p_target = chi2_pvalue(counts, target_p, SEEDS)
    p_draft = chi2_pvalue(counts, draft_p, SEEDS)
    assert p_target > P_THRESHOLD, f"sampled pairs do not follow the target (p={p_target:.2e}): {counts}"
    assert p_draft < P_THRESHOLD, f"test has no power: cannot tell the draft apart (p={p_draft:.2e})"


def test_the_default_configuration_samples_the_target(mismatched):
    """The default proposer, the speculation gate and auto k (the choices that change with the
    load) under 4 concurrent streams: the coupled sampler keeps the pairs the target's; the
    draft's joint is rejected on the same counts."""
    from transformers import AutoTokenizer

    stack, target_dir, draft_dir = mismatched
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    counts, drafted, _ = first_pairs(stack.addresses["orch-default"], proposer="default", k=0)
    p_target = chi2_pvalue(counts, joint(target_dir, prompt_ids), SEEDS)
    p_draft = chi2_pvalue(counts, joint(draft_dir, prompt_ids), SEEDS)
    print(f"\ndefault configuration: {drafted} tokens drafted over {SEEDS} seeds, p_target={p_target:.3f}")
    assert p_target > P_THRESHOLD, f"sampled pairs do not follow the target (p={p_target:.2e}): {counts}"
    assert p_draft < P_THRESHOLD, f"test has no power: cannot tell the draft apart (p={p_draft:.2e})"


GRAMMAR = "[a-h ]{1,16}"  # a regex: tokens of these characters only


def constrained_joint(model_dir, prompt_ids: list[int]) -> tuple[dict, dict]:
    """P(t1, t2) under the grammar (mask, then top-k, renormalised), and without the mask."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.common.grammar import Constraint, Grammars
    from specdec.core import masks

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = model.get_output_embeddings().weight.shape[0]
    grammars = Grammars(tok, vocab, [tok.eos_token_id])

    def dist(ids: list[int], prefix: list[int]) -> dict[int, float]:
        matcher = grammars.matcher(Constraint("regex", GRAMMAR))
        matcher.commit(prefix)
        allowed = masks.unpack(torch.from_numpy(matcher.round_masks([], False).words), vocab)[0]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].masked_fill(~allowed, float("-inf"))
        top = torch.topk(logits, TOP_K)
        probs = torch.softmax(top.values.double(), dim=-1)
        return {t: p for t, p in zip(top.indices.tolist(), probs.tolist()) if p > 0}

    out = {}
    for t1, p1 in dist(prompt_ids, []).items():
        for t2, p2 in dist(prompt_ids + [t1], [t1]).items():
            out[(t1, t2)] = p1 * p2
    return out


@pytest.mark.parametrize("orch", ["orch", "orch-rejection"], ids=["coupled", "rejection"])
def test_constrained_sampling_follows_the_masked_target(mismatched, orch):
    """Under a grammar the draft (which does not know it) proposes forbidden tokens too; the
    first two tokens must still follow the masked, renormalised target. Power check: the
    unconstrained target's joint is rejected on the same counts."""
    from transformers import AutoTokenizer

    stack, target_dir, _ = mismatched
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    counts, drafted, accepted = first_pairs(stack.addresses[orch], check=_is_seeded_draft, regex=GRAMMAR)
    want = constrained_joint(target_dir, prompt_ids)
    # Coupled, drafts the grammar forbids are cut before the Score (no q to reject them with).
    assert drafted > 100 and 0.05 < accepted / drafted < 0.99, (drafted, accepted)
    p_masked = chi2_pvalue(counts, want, SEEDS)
    p_free = chi2_pvalue(counts, joint(target_dir, prompt_ids), SEEDS)
    assert p_masked > P_THRESHOLD, f"constrained pairs do not follow the masked target (p={p_masked:.2e}): {counts}"
    assert p_free < P_THRESHOLD, f"test has no power: cannot tell the mask apart (p={p_free:.2e})"

"""The playground page in a real browser (Debian's Chromium, headless, through playwright), one
test per step on the tiny models, every other origin refused (the network cut off but for the
gateway). Each step's counters are checked against the same request made over gRPC."""
from __future__ import annotations

import re
import urllib.request

import pytest

from specdec.core import speedup
from tests.playground.browser import counters, fill, remaining, submit
from tests.playground.conftest import start_gateway

PROMPT = "The capital of France is"
GUESSABLE = "The dog"  # the tiny target's greedy text from here tokenises back to its own tokens


def _round_trip_prefix(tokenizer, ids: list[int], longest: int) -> int:
    """The longest m <= longest whose text tokenises back to ids[:m] (a guess the page can type)."""
    for m in range(min(longest, len(ids)), 0, -1):
        text = tokenizer.decode(ids[:m])
        if tokenizer.encode(text, add_special_tokens=False) == list(ids[:m]):
            return m
    return 0


def test_step1_one_token_per_pass(pg, grpc_client, page_at):
    ref = grpc_client.complete(PROMPT, max_new_tokens=9, temperature=0.0, proposer="none")
    page = page_at(pg.base)
    before = remaining(page)
    fill(page, {"#step1-prompt": PROMPT, "#step1-tokens": 9})
    submit(page, "#step1 form")
    n = ref.stats.new_tokens
    assert n == ref.stats.target_passes
    assert counters(page, "#step1") == {"this": (n, n), "twin": (n, n)}
    assert page.locator("#step1-out .tok").count() == n
    assert page.locator("#step1-out sub").all_inner_texts() == [f"#{i}" for i in range(1, n + 1)]
    assert remaining(page) == before - n  # charged in target passes


def test_step2_all_at_once(pg, grpc_client, page_at):
    text = "A quick brown fox jumps over the lazy dog."  # not run before: not in the cache
    ref = grpc_client.predict(text, top_k=3)
    page = page_at(pg.base)
    before = remaining(page)
    fill(page, {"#step2-text": text, "#step2-topk": 3})
    submit(page, "#step2 form")
    n = len(ref.tokens)  # n - 1 positions inside the text, plus the one after it
    assert counters(page, "#step2") == {"this": (1, n), "twin": (n, n)}
    items = page.locator("#step2-out > li")
    assert items.count() == n + 1
    for i, token in enumerate(ref.tokens[1:], start=1):
        top = items.nth(i).locator(".topk li").first.inner_text()
        assert top.startswith(token.predicted[0].text.replace(" ", "␣")), (i, top)
    same = sum(t.predicted[0].id == t.id for t in ref.tokens[1:])
    assert f"matches the text at {same} of {n - 1} positions" in page.inner_text("#step2-summary")
    assert remaining(page) == before - 1


def test_step3_you_guess(pg, grpc_client, tokenizer, page_at):
    ref = grpc_client.complete(GUESSABLE, max_new_tokens=8, temperature=0.0, proposer="none")
    m = _round_trip_prefix(tokenizer, list(ref.token_ids), 5)
    assert m >= 2, "no guessable prefix in the tiny target's greedy output"
    guess = tokenizer.decode(ref.token_ids[:m]) + " zebra"
    check = grpc_client.check(GUESSABLE, guess)
    assert check.accepted == m  # the guess is right for m tokens, then wrong
    page = page_at(pg.base)
    fill(page, {"#step3-prompt": GUESSABLE, "#step3-guess": guess})
    submit(page, "#step3 form")
    assert counters(page, "#step3") == {"this": (1, m + 1), "twin": (m + 1, m + 1)}
    assert page.locator("#step3-out .tok.accepted").count() == m
    assert page.locator("#step3-out .tok.rejected").count() == 1
    assert page.locator("#step3-out .tok.recovered").count() == 1
    assert page.get_attribute("#step3-equality", "data-equal") == "true"
    assert "yes" in page.inner_text("#step3-equality")


@pytest.mark.parametrize("proposer", ["lookup", "draft", "combined", "guess"])
def test_step4_copy_and_check(pg, grpc_client, tokenizer, page_at, proposer):
    prompt = GUESSABLE
    ref = grpc_client.complete(prompt, max_new_tokens=16, temperature=0.0, proposer="none")
    page = page_at(pg.base)
    # A good guess: as much of the target's own text as its tokens survive being typed.
    good = _round_trip_prefix(tokenizer, list(ref.token_ids), len(ref.token_ids))
    assert good >= 2, "no guessable prefix in the tiny target's greedy output"
    guess = tokenizer.decode(ref.token_ids[:good])
    fill(page, {"#step4-prompt": prompt, "#step4-tokens": 16, "#step4-k": 4, "#step4-guess": guess})
    page.select_option("#step4-proposer", proposer)
    submit(page, "#step4 form")
    got = counters(page, "#step4")
    passes, tokens = got["this"]
    n = ref.stats.new_tokens
    assert tokens == n and got["twin"] == (n, n)
    rows = page.locator("#step4-out > li")
    assert rows.count() == passes  # one row per round, one round per target pass
    assert page.get_attribute("#step4-equality", "data-equal") == "true"
    sources = set(page.locator("#step4-out .source").all_inner_texts())
    assert sources <= {"TARGET", proposer.upper(), "LOOKUP", "DRAFT"}
    accepted = page.locator("#step4-out .tok.accepted").count()
    if proposer in ("draft", "guess"):
        assert proposer.upper() in sources and accepted > 0
        assert passes == tokens - accepted < n  # every accepted draft saved a pass
    if proposer == "guess":
        assert accepted >= min(good, 4)


def test_step5_speedup_model_and_sampling_panel(pg, page_at):
    page = page_at(pg.base)
    fill(page, {"#step5-prompt": "The cat sat on the mat", "#step5-tokens": 12})
    submit(page, "#step5 form")
    got = counters(page, "#step5-counters")
    assert got["twin"][0] == got["twin"][1] == got["this"][1] == 12
    assert got["this"][0] <= 12
    measured = page.locator("#step5-measured")
    alpha, c, v = (float(measured.get_attribute(f"data-{x}")) for x in ("alpha", "c", "v"))
    assert 0 <= alpha <= 1 and c >= 0 and v > 0
    # The sliders start at the measured values; the prediction is specdec.core.speedup's.
    slider = {s: float(page.input_value(f"#s-{s}")) for s in ("alpha", "k", "c", "v")}
    assert slider["alpha"] == pytest.approx(alpha, abs=0.006) and slider["k"] == 4

    def predicted() -> float:
        page.wait_for_function("document.querySelector('#step5-speedup').dataset.speedup !== undefined")
        return float(page.get_attribute("#step5-speedup", "data-speedup"))

    page.wait_for_function(f"Math.abs(document.querySelector('#step5-speedup').dataset.speedup - "
                           f"{speedup.speedup(slider['alpha'], 4, slider['c'], slider['v'])}) < 1e-9")
    assert predicted() == pytest.approx(speedup.speedup(slider["alpha"], 4, slider["c"], slider["v"]))
    page.focus("#s-k")
    page.keyboard.press("ArrowRight")  # keyboard: k 4 -> 5
    assert page.inner_text("#o-k") == "5"
    want = speedup.speedup(slider["alpha"], 5, slider["c"], slider["v"])
    page.wait_for_function(f"Math.abs(document.querySelector('#step5-speedup').dataset.speedup - {want}) < 1e-9")
    assert page.locator("#chart-k path.curve").count() == 1

    fill(page, {"#sample-prompt": "The dog sat on the", "#sample-draws": 3000})
    submit(page, "#sample-form")
    verdict = page.locator("#sample-verdict")
    assert verdict.get_attribute("data-consistent") == "true", verdict.inner_text()
    assert float(verdict.get_attribute("data-p-value")) > 0.01
    assert counters(page, "#sample-counters") == {"this": (1, 3000), "twin": (3000, 3000)}
    assert page.locator("#sample-out tbody tr").count() >= 2
    page.check("input[name=sampler][value=wrong]")  # the control
    before = remaining(page)
    submit(page, "#sample-form")
    assert verdict.get_attribute("data-consistent") == "false", verdict.inner_text()
    assert float(verdict.get_attribute("data-p-value")) < 1e-6
    assert "NOT the target's p" in verdict.inner_text()
    assert remaining(page) == before  # the same p and q: from the cache


def _scored(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("specdec_requests_total") and 'method="Score"' in line)


def test_pass_quota_stops_the_31st_pass_with_a_clear_message(pg, grpc_client, page_at):
    """The default quota, 30 target passes a minute: 25 passes in step 1, a step-4 run cut after
    the 5 left, then the 31st pass is refused before it reaches the target; a repeat is free."""
    ref = grpc_client.complete(PROMPT, max_new_tokens=25, temperature=0.0, proposer="none")
    assert ref.stats.target_passes == 25, "the tiny target stopped early on this prompt"
    base = start_gateway(pg.stack, "gateway-quota")  # the defaults: 30 passes per minute
    page = page_at(base)
    assert remaining(page) == 30
    fill(page, {"#step1-prompt": PROMPT, "#step1-tokens": 25})
    submit(page, "#step1 form")
    assert remaining(page) == 5
    fill(page, {"#step4-prompt": PROMPT + " and", "#step4-tokens": 20})
    page.select_option("#step4-proposer", "draft")
    submit(page, "#step4 form")
    assert counters(page, "#step4")["this"][0] == 5
    assert "Stopped after 5 target passes" in page.inner_text("#step4 .status")
    assert remaining(page) == 0
    scored = _scored(pg.target_metrics)
    fill(page, {"#step2-text": "The cat sat"})
    submit(page, "#step2 form")
    message = page.locator("#step2 .status")
    assert message.get_attribute("role") == "alert"
    assert re.search(r"Pass quota reached: 30 target passes per minute per visitor\. "
                     r"The next pass frees up in \d+ s", message.inner_text())
    assert _scored(pg.target_metrics) == scored  # the 31st pass never ran
    submit(page, "#step1 form")  # the same run again: from the cache, free
    assert counters(page, "#step1")["this"] == (25, 25)
    assert "from the cache: 0 passes charged" in page.inner_text("#step1 .counter.this .note")
    pg.stack.stop_one("gateway-quota")


def test_keyboard_labels_and_reduced_motion(pg, page_at):
    page = page_at(pg.base, reduced_motion="reduce")
    # Every control has a label (or a legend), every button a name.
    unlabeled = page.evaluate("""[...document.querySelectorAll('input, select, textarea')]
        .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))
        .map(e => e.id || e.name)""")
    assert unlabeled == []
    assert page.evaluate("[...document.querySelectorAll('button')].every(b => b.textContent.trim())")
    assert page.get_attribute("html", "lang") == "en"
    # Keyboard only: Tab from the token count to the button, Enter runs the step.
    fill(page, {"#step1-prompt": PROMPT, "#step1-tokens": 3})
    page.focus("#step1-tokens")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.closest('#step1') !== null && "
                         "document.activeElement.tagName") == "BUTTON"
    page.keyboard.press("Enter")
    page.wait_for_selector('#step1 form[aria-busy="false"]')
    assert counters(page, "#step1")["this"][1] >= 1
    # Reduced motion: the token chips do not animate.
    assert page.evaluate("getComputedStyle(document.querySelector('#step1-out .tok')).animationName") == "none"
    moving = page_at(pg.base)  # the same page without the preference does animate
    fill(moving, {"#step1-prompt": PROMPT, "#step1-tokens": 3})
    submit(moving, "#step1 form")
    assert moving.evaluate("getComputedStyle(document.querySelector('#step1-out .tok')).animationName") == "pop"

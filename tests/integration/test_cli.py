"""The `specdec` console command: generate against a stack, `up` with tiny models, the demo."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from specdec.runtime import procs

SPECDEC = [sys.executable, "-m", "launcher.cli"]


def _closed(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return False
    except OSError:
        return True


def test_generate_streams_text_and_prints_stats(stack, client):
    ref = client.complete("The cat sat on the", max_new_tokens=12, proposer="none")
    out = subprocess.run(
        [*SPECDEC, "generate", "--address", stack.addresses["orch"], "--raw", "--max-new-tokens",
         "12", "--proposer", "draft", "-k", "3", "The cat sat on the"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == ref.text + "\n"
    assert re.search(r"12 tokens in .* tokens/s", out.stderr)
    assert "target passes" in out.stderr and "acceptance" in out.stderr


def test_generate_reports_bad_input_clearly(stack):
    out = subprocess.run(
        [*SPECDEC, "generate", "--address", stack.addresses["orch"], "--max-new-tokens", "0", "hi"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "max_new_tokens" in out.stderr


def test_up_starts_everything_and_ctrl_c_leaves_no_orphans(tiny_pair, tmp_path):
    """`specdec up` with the target named by a Hugging Face id, offline from a hub cache the test
    builds: the API serves it under that id, and an OpenAI client naming it gets an answer."""
    from openai import OpenAI

    from tests.hubcache import publish

    target_dir, draft_dir = tiny_pair
    publish(target_dir, tmp_path / "hub", "acme/tiny-target")
    log = tmp_path / "up.log"
    proc = procs.start([*SPECDEC, "up", "--port", str(procs.free_port()), "--threads", "1",
                        "--target-model", "acme/tiny-target", "--draft-model", str(draft_dir),
                        "--logs", str(tmp_path / "logs"), "--gateway-port", str(procs.free_port())],
                       env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}, log_path=log)
    try:
        deadline = time.monotonic() + 180
        while "ready:" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        text = log.read_text()
        addresses = dict(re.findall(r"^(target|draft|orchestrator)\s+(\S+)$", text, re.M))
        assert set(addresses) == {"target", "draft", "orchestrator"}
        out = subprocess.run([*SPECDEC, "generate", "--address", addresses["orchestrator"],
                              "--max-new-tokens", "5", "Hello"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "5 tokens in" in out.stderr, out.stderr
        page = re.search(r"^playground\s+(http://(\S+)/playground)$", text, re.M)
        with urllib.request.urlopen(page.group(1), timeout=10) as reply:  # the page is up
            assert b"specdec playground" in reply.read()
        addresses["gateway"] = page.group(2)
        api = OpenAI(base_url=f"http://{page.group(2)}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in api.models.list().data][0] == "acme/tiny-target"
        # Greedy and ignore_eos: the gateway's default temperature is 1 and an unseeded draw may
        # end early on an end token; the length asserted here must not depend on the draw.
        answer = api.completions.create(model="acme/tiny-target", prompt="The cat", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert answer.model == "acme/tiny-target" and answer.usage.completion_tokens == 5
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert all(_closed(a) for a in addresses.values()), "a child outlived `specdec up`"
    finally:
        procs.stop(proc)


@pytest.mark.slow
def test_demo_on_the_embedded_default_models(tmp_path):
    started = time.monotonic()
    out = subprocess.run(
        [*SPECDEC, "demo", "What is the capital of France?", "--max-new-tokens", "24",
         "--logs", str(tmp_path), "--port", str(procs.free_port())],
        capture_output=True, text=True, timeout=400,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "tokens/s" in out.stderr and "everything stopped" in out.stderr
    assert re.search(r"vs target-only [\d.]+ tokens/s = [\d.]+x", out.stderr), out.stderr
    addresses = re.findall(r"^(?:target|draft|orchestrator)\s+(\S+)$", out.stderr, re.M)
    assert len(addresses) == 3 and all(_closed(a) for a in addresses)
    print(f"demo took {time.monotonic() - started:.1f} s")


def test_demo_splits_the_cores_and_compares_with_target_only(tiny_pair, tmp_path):
    """The launcher gives each service its share of the cores (not all of them each), and the
    demo prints its speed next to target-only's on the same prompt and stack. Without --logs its
    services log to a temporary folder, removed after a clean run."""
    from specdec.runtime.launch import available_cores, split_threads

    target_dir, draft_dir = tiny_pair
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run(
        [*SPECDEC, "demo", "The cat sat on the", "--raw", "--max-new-tokens", "12", "--default-k", "2",
         "--target-model", str(target_dir), "--draft-model", str(draft_dir), "--port", str(procs.free_port())],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert out.returncode == 0, out.stderr
    assert not list(scratch.glob("specdec-up-*")), "the demo left its temporary logs folder behind"
    split = split_threads()
    assert f"target {split.target} threads, draft {split.draft}, orchestrator 1" in out.stderr
    assert f"{available_cores()} cores" in out.stderr
    # The exactness reference: target-only through the same stack, in the same dtype.
    assert re.search(r"speed: combined [\d.]+ tokens/s vs target-only [\d.]+ tokens/s = [\d.]+x "
                     r"\(\d+ vs \d+ tokens; same tokens: yes\)", out.stderr), out.stderr
    # ... and next to transformers' own generate in-process, same weights, greedy: the same tokens.
    assert re.search(r"vs in-process generate [\d.]+ tokens/s = [\d.]+x \(\d+ vs \d+ tokens; same tokens: yes\)",
                     out.stderr), out.stderr


def test_a_demo_that_cannot_start_says_why_in_one_line_and_keeps_the_logs_it_has(tmp_path):
    """A model path that is not there: one line naming it, no traceback, no folder left behind.
    A target that dies loading: its log tail, and the temporary logs folder kept and named."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    missing = subprocess.run([*SPECDEC, "demo", "Hi", "--target-model", str(tmp_path / "no-such-model")],
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr, missing.stderr
    assert f"specdec demo: --target-model '{tmp_path / 'no-such-model'}'" in missing.stderr, missing.stderr
    assert not list(scratch.glob("specdec-up-*"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no model_type: the target service cannot load it
    dead = subprocess.run([*SPECDEC, "demo", "Hi", "--target-model", str(broken), "--timeout", "60",
                           "--port", str(procs.free_port())], capture_output=True, text=True, timeout=120, env=env)
    assert dead.returncode == 1 and "Traceback" not in dead.stderr, dead.stderr
    assert "cannot load the model" in dead.stderr  # the target's log tail
    kept = list(scratch.glob("specdec-up-*"))
    assert len(kept) == 1 and f"logs are kept in {kept[0]}" in dead.stderr, dead.stderr
    assert "cannot load the model" in (kept[0] / "target.log").read_text()

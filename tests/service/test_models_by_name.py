"""Models by name (engine.model.hub): a Hugging Face id loaded offline from a hub cache on disk,
at a revision; an id the cache lacks refused in one line that says what to do; --max-model-len.

The cache is built from the tiny target in the layout `hf download` leaves (tests/hubcache.py);
HF_HUB_OFFLINE=1 throughout, so nothing is fetched.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.model import hub, loader
from specdec.runtime import procs
from specdec.runtime.launch import child_env, orchestrator_argv, service_argv
from tests.hubcache import publish

REPO = "acme/tiny-target"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tiny_pair, tmp_path_factory) -> SimpleNamespace:
    """HF_HOME holding the tiny target as acme/tiny-target (main -> its one commit)."""
    home = tmp_path_factory.mktemp("hf-home")
    commit = publish(tiny_pair[0], home / "hub", REPO)
    return SimpleNamespace(home=home, hub=home / "hub", commit=commit, folder=tiny_pair[0])


@pytest.fixture
def offline(cache, monkeypatch) -> SimpleNamespace:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(cache.home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return cache


@pytest.mark.parametrize("spec, is_id", [
    ("acme/tiny-target", True), ("Qwen/Qwen2.5-0.5B-Instruct", True), ("a.b/c_d-1", True),
    ("/models/x", False), ("./acme/x", False), ("acme/x/y", False), ("tiny", False), ("~/x", False),
    ("../x", False), ("acme/..", False), ("acme/", False),
])
def test_what_is_shaped_like_an_id(spec, is_id) -> None:
    assert hub.is_hub_id(spec) is is_id


def test_an_id_loads_offline_from_the_cache_under_its_own_name(offline) -> None:
    loaded = loader.load(REPO)
    assert loaded.name == REPO  # the model id the API serves
    assert loaded.path == offline.hub / "models--acme--tiny-target" / "snapshots" / offline.commit
    by_folder = loader.load(str(offline.folder))
    assert loaded.tokenizer_fingerprint == by_folder.tokenizer_fingerprint
    assert loaded.context_length == by_folder.context_length == 512
    for a, b in zip(loaded.model.state_dict().values(), by_folder.model.state_dict().values()):
        assert a.equal(b)


def test_a_revision_names_a_snapshot_and_hf_hub_cache_the_cache(offline, monkeypatch) -> None:
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HF_HUB_CACHE", str(offline.hub))
    folder, name = loader.resolve(REPO, offline.commit)
    assert folder.name == offline.commit and name == REPO
    assert loader.load(REPO, revision=offline.commit, max_model_len=100).context_length == 100


def test_an_existing_local_path_wins_over_an_id(offline, tmp_path, monkeypatch) -> None:
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "tiny-target").symlink_to(offline.folder)
    monkeypatch.chdir(tmp_path)
    folder, name = loader.resolve(REPO)
    assert folder == Path(REPO) and name == "tiny-target"


def test_an_id_absent_offline_says_what_to_do(offline) -> None:
    for spec, revision in (("acme/absent", None), (REPO, "v2")):
        with pytest.raises(hub.ModelUnavailable) as info:
            loader.resolve(spec, revision)
        message = str(info.value)
        shown = revision or "main"
        assert message.startswith(f"--model {spec} (revision {shown}) is not in the Hugging Face cache at "
                                  f"{offline.hub} and HF_HUB_OFFLINE is set"), message
        assert f"hf download {spec} --revision {shown}" in message
        assert "HF_HOME" in message and "pass a local folder" in message and "\n" not in message


def test_max_model_len_caps_and_is_checked() -> None:
    assert loader.capped_context(512, None) == 512
    assert loader.capped_context(512, 64) == 64
    assert loader.capped_context(0, 64) == 64  # a model that does not say its context
    with pytest.raises(ValueError, match="exceeds the model's context length of 512"):
        loader.capped_context(512, 1024)
    with pytest.raises(ValueError, match="at least 1"):
        loader.capped_context(512, 0)


def test_a_chat_template_file_is_read_and_checked(tmp_path) -> None:
    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    bad.write_text("{% for m in messages %}")
    assert loader.read_chat_template(good) == good.read_text()
    with pytest.raises(ValueError, match="not a Jinja template"):
        loader.read_chat_template(bad)
    with pytest.raises(FileNotFoundError, match="no such file"):
        loader.read_chat_template(tmp_path / "none.jinja")


def test_the_launch_helpers_pass_the_new_flags() -> None:
    argv = service_argv("target", 1, model=REPO, revision="v1", max_model_len=64)
    assert argv[argv.index("--model"):argv.index("--model") + 6] == [
        "--model", REPO, "--revision", "v1", "--max-model-len", "64"]
    argv = orchestrator_argv(1, tokenizer=REPO, tokenizer_revision="v1", chat_template="t.jinja")
    at = argv.index("--tokenizer")
    assert argv[at:at + 6] == ["--tokenizer", REPO, "--tokenizer-revision", "v1", "--chat-template", "t.jinja"]


def _exit(argv: list[str], cache, tmp_path: Path, name: str) -> tuple[int, str]:
    env = child_env(1, PYTHONPATH=str(ROOT), HF_HOME=str(cache.home), HF_HUB_OFFLINE="1")
    proc = procs.start(argv, env=env, log_path=tmp_path / f"{name}.log")
    try:
        code = proc.wait(timeout=90)
    finally:
        procs.stop(proc)
    return code, (tmp_path / f"{name}.log").read_text()


def test_services_given_an_id_absent_offline_exit_with_one_line(cache, tmp_path) -> None:
    """The target service and the orchestrator (exit 2) and `specdec up` (exit 1, before starting
    anything): the message, no traceback."""
    code, log = _exit(service_argv("target", procs.free_port(), model="acme/absent", threads=1),
                      cache, tmp_path, "target")
    assert code == 2 and "Traceback" not in log, log
    assert ("cannot load the model: --model acme/absent (revision main) is not in the Hugging Face "
            "cache") in log and "hf download acme/absent --revision main" in log, log
    code, log = _exit(orchestrator_argv(procs.free_port(), tokenizer="acme/absent", threads=1,
                                        targets=["127.0.0.1:1"]), cache, tmp_path, "orchestrator")
    assert code == 2 and "Traceback" not in log, log
    assert "refusing to start: --tokenizer acme/absent (revision main) is not in the Hugging Face" in log
    code, log = _exit([sys.executable, "-m", "launcher.cli", "up", "--target-model", "acme/absent",
                       "--target-revision", "v3", "--logs", str(tmp_path / "up")], cache, tmp_path, "up")
    assert code == 1 and "Traceback" not in log, log
    assert log.startswith("specdec up: --target-model acme/absent (revision v3) is not in the Hugging "
                          "Face cache"), log
    assert not (tmp_path / "up").exists() or not any((tmp_path / "up").iterdir())  # nothing started

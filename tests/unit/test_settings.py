"""The settings definitions (specdec.runtime.settings): environment names by rule, deprecated aliases, the
generated reference page, and every SPECDEC_* name in the code defined once."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from specdec.runtime.settings import APPEND, ENV_ONLY, ON, SWITCH, Flag, Group, Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "engine", "draft_service", "target_service", "orchestrator", "client", "gateway",
            "distill", "benchmarks", "scripts")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def processes():
    return _generator().processes()


SAMPLE = Settings("sample", "a sample process", (Group("g", (
    Flag("max-items", "items", 4, int, aliases=("old-items",), env_aliases=("SPECDEC_OLD_ITEMS",)),
    Flag("fast", "a default-on switch", True, kind=SWITCH),
    Flag("slow", "a default-off switch", False, kind=SWITCH),
    Flag("loud", "an on-only flag", False, kind=ON),
    Flag("peer", "repeatable", [], kind=APPEND),
    Flag("out", "required unless the environment gives it", None, required=True),
)),))


def test_environment_names_follow_the_rule() -> None:
    assert env_name("max-batch-tokens") == "SPECDEC_MAX_BATCH_TOKENS"
    assert SAMPLE.env_names() == ["SPECDEC_MAX_ITEMS", "SPECDEC_FAST", "SPECDEC_SLOW", "SPECDEC_LOUD",
                                  "SPECDEC_PEER", "SPECDEC_OUT"]


def test_flags_win_over_the_environment_which_wins_over_the_default() -> None:
    env = {"SPECDEC_MAX_ITEMS": "7", "SPECDEC_OUT": "x"}
    assert SAMPLE.parser(env).parse_args([]).max_items == 7
    assert SAMPLE.parser(env).parse_args(["--max-items", "9"]).max_items == 9
    assert SAMPLE.parser({}).parse_args(["--out", "y"]).max_items == 4
    with pytest.raises(SystemExit):  # --out is required when the environment lacks it
        SAMPLE.parser({}).parse_args([])


@pytest.mark.parametrize("value,fast,slow,loud", [("1", True, True, True), ("off", False, False, False),
                                                    ("junk", True, False, False)])
def test_switches_from_the_environment(value, fast, slow, loud) -> None:
    env = {"SPECDEC_FAST": value, "SPECDEC_SLOW": value, "SPECDEC_LOUD": value, "SPECDEC_OUT": "x"}
    args = SAMPLE.parser(env).parse_args([])
    assert (args.fast, args.slow, args.loud) == (fast, slow, loud)
    assert SAMPLE.parser(env).parse_args(["--no-fast", "--slow"]).fast is False


def test_repeated_flags_take_one_entry_from_the_environment() -> None:
    assert SAMPLE.parser({"SPECDEC_PEER": "a,b", "SPECDEC_OUT": "x"}).parse_args([]).peer == ["a,b"]
    assert SAMPLE.parser({"SPECDEC_OUT": "x"}).parse_args(["--peer", "a", "--peer", "b"]).peer == ["a", "b"]


def test_deprecated_names_work_and_warn() -> None:
    with pytest.warns(FutureWarning, match="--old-items is deprecated; use --max-items"):
        assert SAMPLE.parser({}).parse_args(["--old-items", "3", "--out", "x"]).max_items == 3
    with pytest.warns(FutureWarning, match="SPECDEC_OLD_ITEMS is deprecated; use SPECDEC_MAX_ITEMS"):
        assert SAMPLE.parser({"SPECDEC_OLD_ITEMS": "5"}).parse_args(["--out", "x"]).max_items == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current names do not warn
        assert SAMPLE.parser({"SPECDEC_MAX_ITEMS": "6", "SPECDEC_OLD_ITEMS": "5"}).parse_args(
            ["--out", "x"]).max_items == 6
    help_text = SAMPLE.parser({}).format_help()
    assert "--old-items" not in help_text and "[SPECDEC_MAX_ITEMS] (default: 4)" in help_text


def test_the_configuration_page_is_current() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == _generator().render(), "docs/configuration.md is stale: run `make config-docs`"
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()


def test_the_page_lists_every_flag_of_every_process(processes) -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    titles = [title for title, _, _ in processes]
    assert {"Target service", "Draft service", "Orchestrator", "Gateway", "Launcher: specdec up",
            "Launcher: specdec demo", "Distill"} <= set(titles)
    for title, _, settings in processes:
        section = page.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        for flag in settings.flags:
            assert f"| `{flag.options}` |" in section, (title, flag.name)
            if flag.has_env(settings):
                assert f"`{env_name(flag.name)}`" in section, (title, flag.name)


def test_help_comes_from_the_same_definitions(processes) -> None:
    for title, _, settings in processes:
        parser = settings.parser({})
        options = {s for a in parser._actions for s in a.option_strings}
        for flag in settings.flags:
            if flag.kind != "positional":
                assert flag.option in options, (title, flag.name)
                assert all(("--" if len(a) > 1 else "-") + a in options for a in flag.aliases)
        # Nothing in a parser that the definitions do not have (except -h).
        defined = {f.option for f in settings.flags} | {f"--no-{f.name}" for f in settings.flags}
        defined |= {("--" if len(a) > 1 else "-") + a for f in settings.flags for a in f.aliases}
        assert options - defined == {"-h", "--help"}, title


def test_python_m_help_lists_the_environment_names() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[SPECDEC_PLAYGROUND_PASSES_PER_MINUTE] (default: 30)" in " ".join(out.stdout.split())


def _names_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for name in set(re.findall(r"\bSPECDEC_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_specdec_name_in_the_code_is_defined_once(processes) -> None:
    flags = {env_name(f.name) for _, _, s in processes for f in s.flags if f.has_env(s)}
    aliases = {a for _, _, s in processes for f in s.flags for a in f.env_aliases}
    env_only = {e.name for e in ENV_ONLY}
    assert not flags & env_only and not flags & aliases
    unknown = {n: where for n, where in _names_in_code().items() if n not in flags | aliases | env_only}
    assert unknown == {}
    # Outside the settings definitions no module reads SPECDEC_<flag> itself: no second lookup.
    lookups = [str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
               if re.search(r"""environ[^\n]*f["']SPECDEC_|getenv\(f["']SPECDEC_""", p.read_text())]
    assert lookups == []


def test_no_environment_name_means_two_things(processes) -> None:
    """A SPECDEC_* name shared by several processes has one kind and type everywhere; the two
    session lifetimes have names of their own."""
    seen: dict[str, tuple] = {}
    for title, _, settings in processes:
        for f in settings.flags:
            if f.has_env(settings):
                shape = (f.kind, f.type)
                assert seen.setdefault(env_name(f.name), shape) == shape, (title, f.name)
    owners = {env_name(f.name): title for title, _, s in processes for f in s.flags if f.has_env(s)}
    assert "SPECDEC_SESSION_TTL" not in owners
    assert owners["SPECDEC_RECORD_TTL"] == "Orchestrator"
    assert owners["SPECDEC_KV_IDLE_TTL"] in ("Target service", "Draft service")
    client_cert = [t for t, _, s in processes for f in s.flags if f.name == "tls-cert"]
    assert client_cert and all("service" in t or t == "Orchestrator" for t in client_cert), client_cert


def test_the_old_names_keep_their_meaning_on_each_process(monkeypatch) -> None:
    from gateway.__main__ import parse_args as gateway_args
    from orchestrator.__main__ import parse_args as orchestrator_args
    from model_service.settings import service_settings
    from target_service.role import ROLE

    monkeypatch.delenv("SPECDEC_SESSION_TTL", raising=False)
    with pytest.warns(FutureWarning, match="--session-ttl is deprecated; use --record-ttl"):
        assert orchestrator_args(["--session-ttl", "7"]).record_ttl == 7
    with pytest.warns(FutureWarning, match="SPECDEC_SESSION_TTL is deprecated; use SPECDEC_KV_IDLE_TTL"):
        assert service_settings(ROLE).parser({"SPECDEC_SESSION_TTL": "9"}).parse_args([]).kv_idle_ttl == 9
    with pytest.warns(FutureWarning, match="--tls-cert is deprecated; use --client-cert"):
        assert gateway_args(["--tls-cert", "c.pem"]).client_cert == "c.pem"
    with pytest.warns(FutureWarning, match="SPECDEC_GATEWAY_PORT is deprecated; use SPECDEC_PORT"):
        monkeypatch.delenv("SPECDEC_PORT", raising=False)
        monkeypatch.setenv("SPECDEC_GATEWAY_PORT", "8123")
        assert gateway_args([]).port == 8123

"""specdec.runtime.security: token files, bearer parsing, URL redaction, which flags mean what."""
from __future__ import annotations

import pytest

from specdec.runtime.errors import PermissionDenied, Unauthenticated
from specdec.runtime.security import TENANT, BearerGuard, TokenTable, bearer_token, parse_tokens, redact_url


def test_token_files_lines_and_json() -> None:
    lines = "# comment\nalice:aaaaaaaaaaaaaaaaaaaa\n\nbob: bbbbbbbbbbbbbbbbbbbb\n"
    assert parse_tokens(lines) == {"aaaaaaaaaaaaaaaaaaaa": "alice", "bbbbbbbbbbbbbbbbbbbb": "bob"}
    js = '{"alice": ["aaaaaaaaaaaaaaaaaaaa", "cccccccccccccccccccc"], "bob": "bbbbbbbbbbbbbbbbbbbb"}'
    assert parse_tokens(js)["cccccccccccccccccccc"] == "alice"
    for bad in ("alice aaaaaaaaaaaaaaaaaaaa", "alice:short", "a b:aaaaaaaaaaaaaaaaaaaa", "",
                "a:aaaaaaaaaaaaaaaaaaaa\nb:aaaaaaaaaaaaaaaaaaaa"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_guard() -> None:
    guard = BearerGuard(TokenTable({"t" * 20: "alice"}))
    with pytest.raises(Unauthenticated):
        guard("/specdec.v1.Orchestrator/Generate", ())
    with pytest.raises(Unauthenticated):
        guard("/specdec.v1.Orchestrator/Generate", (("authorization", "Basic xyz"),))
    with pytest.raises(PermissionDenied):
        guard("/specdec.v1.Orchestrator/Generate", (("authorization", "Bearer " + "u" * 20),))
    guard("/specdec.v1.Orchestrator/Generate", (("authorization", "Bearer " + "t" * 20),))
    assert TENANT.get() == "alice"
    guard("/grpc.health.v1.Health/Check", ())  # open
    assert bearer_token((("Authorization", "bearer abc"),)) == "abc"


def test_redact_url() -> None:
    assert redact_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("rediss://user:pw@h/0?ssl_ca_certs=/x") == "rediss://user:***@h/0?ssl_ca_certs=/x"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_the_orchestrators_service_token_is_not_its_own_credential() -> None:
    from orchestrator.__main__ import parse_args
    from specdec.runtime.security import security_from_args

    sec = security_from_args(parse_args(["--service-token", "x" * 20]))
    assert sec.service_token == "" and sec.guard().table is None


def test_generated_tokens_never_start_with_a_dash(monkeypatch) -> None:
    """A token on a command line (`--service-token -x...`) would read as another flag."""
    from specdec.runtime import credentials

    drawn = iter(["-first", "-second", "third"])
    monkeypatch.setattr(credentials.random, "token_urlsafe", lambda n: next(drawn))
    assert credentials._token(32) == "third"
    monkeypatch.undo()
    assert not any(credentials._token(2).startswith("-") for _ in range(2000))  # 1 in 64 would

"""The image's helpers: launcher.fetch (components/model-hub's init container) and
launcher.healthcheck (the Dockerfile's HEALTHCHECK), without a Hub or a container."""
from __future__ import annotations

import http.server
import sys
import threading
import types
from concurrent import futures
from pathlib import Path

import pytest

from launcher import fetch, healthcheck

# ------------------------------------------------------------------- launcher.fetch


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A stand-in huggingface_hub.snapshot_download: records its calls, writes what the patterns
    ask for from `hub.files` into one snapshot folder."""
    calls: list[dict] = []
    files: list[str] = ["config.json", "tokenizer.json", "model.safetensors"]
    snapshot = tmp_path / "snapshots" / "abc"

    def snapshot_download(repo_id, *, revision, allow_patterns):
        import fnmatch

        calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": list(allow_patterns)})
        snapshot.mkdir(parents=True, exist_ok=True)
        for name in files:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (snapshot / name).write_text("x")
        return str(snapshot)

    module = types.ModuleType("huggingface_hub")
    module.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)
    for name in ("SPECDEC_MODEL", "SPECDEC_REVISION", "SPECDEC_TOKENIZER", "SPECDEC_TOKENIZER_REVISION"):
        monkeypatch.delenv(name, raising=False)
    return types.SimpleNamespace(calls=calls, files=files, snapshot=snapshot)


def test_fetch_downloads_config_tokenizer_and_safetensors_at_the_revision(hub, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_MODEL", "Org/Model-1.5B")
    monkeypatch.setenv("SPECDEC_REVISION", "v2")
    assert fetch.main([]) == 0
    assert hub.calls == [{"repo_id": "Org/Model-1.5B", "revision": "v2",
                          "allow_patterns": fetch.FILES + fetch.WEIGHTS}]
    assert sorted(p.name for p in hub.snapshot.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert "Org/Model-1.5B (revision v2) ->" in capsys.readouterr().out


def test_fetch_takes_bin_weights_where_there_are_no_safetensors(hub):
    hub.files[:] = ["config.json", "tokenizer.json", "pytorch_model.bin"]
    folder = fetch.fetch("org/old-model")
    assert [c["allow_patterns"] for c in hub.calls] == [fetch.FILES + fetch.WEIGHTS, fetch.FILES + fetch.LEGACY_WEIGHTS]
    assert hub.calls[0]["revision"] == "main"
    assert (folder / "pytorch_model.bin").exists()


def test_fetch_tokenizer_only_reads_the_orchestrators_settings_and_skips_weights(hub, monkeypatch):
    monkeypatch.setenv("SPECDEC_MODEL", "org/not-this-one")
    monkeypatch.setenv("SPECDEC_TOKENIZER", "org/target")
    monkeypatch.setenv("SPECDEC_TOKENIZER_REVISION", "0123abcd")
    assert fetch.main(["--tokenizer-only"]) == 0
    assert hub.calls == [{"repo_id": "org/target", "revision": "0123abcd", "allow_patterns": fetch.FILES}]
    assert not (hub.snapshot / "model.safetensors").exists()


@pytest.mark.parametrize("spec", ["", "/models/my-target", "./x/y", "~/m", "a/b/c", "a/../b", "plain"])
def test_fetch_does_nothing_for_what_is_not_a_hub_id(hub, spec, capsys):
    assert fetch.main(["--model", spec]) == 0
    assert hub.calls == []
    assert "nothing to fetch" in capsys.readouterr().out


def test_fetch_leaves_an_existing_local_path_alone(hub, tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert fetch.fetch("org/name") is None and hub.calls == []


def test_fetch_fails_in_one_line(hub, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise OSError("401 Client Error: gated\nmore detail")

    monkeypatch.setattr(sys.modules["huggingface_hub"], "snapshot_download", refuse)
    assert fetch.main(["--model", "meta/gated", "--revision", "main"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "meta/gated" in err and "HF_TOKEN" in err


# ------------------------------------------------------------------- launcher.healthcheck


@pytest.mark.parametrize("argv,env,expected", [
    (["python", "-m", "gateway"], {"SPECDEC_PORT": "8080"}, ("http", "http://127.0.0.1:8080/health")),
    (["python", "-m", "gateway", "--port", "9000"], {"SPECDEC_PORT": "8080"}, ("http", "http://127.0.0.1:9000/health")),
    (["python", "-m", "gateway"], {}, ("http", "http://127.0.0.1:8000/health")),
    (["python", "-m", "target_service", "--advertise-address", "h.target.specdec:50061"],
     {"SPECDEC_PORT": "50061", "SPECDEC_HEALTH_PORT": "50060"}, ("grpc", "127.0.0.1:50060")),
    (["python", "-m", "draft_service", "--health-port=50070"], {}, ("grpc", "127.0.0.1:50070")),
    (["python", "-m", "draft_service"], {"SPECDEC_HEALTH_PORT": "0"}, ("grpc", "127.0.0.1:50062")),
    (["/opt/specdec/bin/python", "-m", "orchestrator"], {"SPECDEC_PORT": "50051"}, ("grpc", "127.0.0.1:50051")),
    (["specdec", "--help"], {}, None),
    (["python", "-m", "distill"], {}, None),
])
def test_healthcheck_picks_the_check_of_the_process_it_finds(argv, env, expected):
    assert healthcheck.check_of(argv, env) == expected


def test_healthcheck_gateway_is_healthy_while_health_answers_200(monkeypatch):
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SPECDEC_PORT", str(server.server_address[1]))
        assert healthcheck.main(["python", "-m", "gateway"]) == 0
        status["code"] = 503  # the orchestrator is not serving
        assert healthcheck.main(["python", "-m", "gateway"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.main(["python", "-m", "gateway"]) == 1  # nothing listens


def test_healthcheck_model_service_asks_its_health_port(monkeypatch):
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name in ("SPECDEC_TLS_CA", "SPECDEC_CLIENT_CERT", "SPECDEC_CLIENT_KEY", "SPECDEC_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    try:
        monkeypatch.setenv("SPECDEC_HEALTH_PORT", str(port))
        assert healthcheck.main(["python", "-m", "target_service"]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
        assert healthcheck.main(["python", "-m", "target_service"]) == 1
    finally:
        server.stop(None)


def test_healthcheck_reads_pid_1(monkeypatch):
    if not Path("/proc/1/cmdline").exists():
        pytest.skip("no /proc")
    assert isinstance(healthcheck.main_argv(), list)

"""compose.yaml validates against the Compose specification (offline) and says what the issue asks."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_validates_against_the_compose_spec_offline():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema",
         "vendor.compose-spec", str(ROOT / "compose.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout


def test_compose_gpus_profiles_and_health_checks():
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    assert {"redis", "target", "draft", "orchestrator", "target-cpu", "draft-cpu"} <= set(services)

    def gpu_ids(name):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        return [d["device_ids"] for d in devices if "gpu" in d["capabilities"]]

    assert gpu_ids("target") == [["0"]] and gpu_ids("draft") == [["1"]]
    assert services["target"]["environment"]["SPECDEC_DEVICE"] == "cuda:0"
    # Each container sees only the GPU it reserves, numbered from 0 inside it.
    assert services["draft"]["environment"]["SPECDEC_DEVICE"] == "cuda:0"
    for name in ("target-cpu", "draft-cpu"):
        assert services[name]["profiles"] == ["cpu"] and "deploy" not in services[name]
        assert services[name]["environment"]["SPECDEC_DEVICE"] == "cpu"
    for name, svc in services.items():
        assert "healthcheck" in svc, name
    for name in ("target", "draft", "target-cpu", "draft-cpu", "orchestrator"):
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "specdec", "health"], name
        env = services[name]["environment"]
        # A model service's TLS port wants the orchestrators' client certificate, which its
        # container does not hold: its health check dials the loopback health port.
        port = env.get("SPECDEC_HEALTH_PORT") or env["SPECDEC_PORT"]
        assert test[3] == f"127.0.0.1:{port}", name
        env = services[name]["environment"]
        assert env["SPECDEC_REDIS_URL"].startswith("rediss://redis:6379/0"), name  # Redis over TLS
        assert env["SPECDEC_TLS_CERT"] and env["SPECDEC_HOST"] == "0.0.0.0", name
    orchestrator = services["orchestrator"]
    assert orchestrator["environment"]["SPECDEC_AUTH_TOKENS"] == "/secrets/tokens"
    assert all(p.startswith("127.0.0.1:") for p in orchestrator["ports"])  # not every interface
    for name in ("target", "draft", "target-cpu", "draft-cpu"):
        assert services[name]["environment"]["SPECDEC_TLS_CLIENT_CA"], name  # mutual TLS


MODEL_SERVICES = ("target", "draft", "target-cpu", "draft-cpu")


def test_compose_mounts_each_container_only_its_own_secrets():
    """Each container mounts its own folder of `specdec secrets` (never ca.key or state.json);
    the model services get no orchestrator credential; nothing runs as root or can gain rights."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, svc in services.items():
        assert not any(secret in entry for entry in (*svc["volumes"], *svc.get("env_file", []))
                       for secret in ("ca.key", "state.json")), name
        role = "orchestrator" if name == "orchestrator" else name.removesuffix("-cpu")
        mounts = [v for v in svc["volumes"] if ":/secrets" in v]
        assert mounts == [f"./secrets/{role}:/secrets:ro"], (name, mounts)
        assert all(f.startswith(f"./secrets/{role}/") for f in svc.get("env_file", [])), name
        assert svc.get("read_only") is True and svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert svc.get("user") not in ("root", "0", "0:0"), name
    for name in MODEL_SERVICES:
        env = services[name]["environment"]
        assert not any(k.startswith(("SPECDEC_CLIENT_", "SPECDEC_SERVICE_TLS_")) or k == "SPECDEC_SERVICE_TOKEN"
                       for k in env), name
        assert services[name]["env_file"] == [f"./secrets/{name.removesuffix('-cpu')}/model.env"]
    assert services["redis"]["user"] == "redis"  # the image's own user (the image runs ours as 10001)


def test_every_secret_file_compose_names_is_one_specdec_secrets_writes(tmp_path):
    from specdec.runtime.credentials import generate

    generate(tmp_path / "secrets")
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, svc in services.items():
        folder = next(v for v in svc["volumes"] if ":/secrets" in v).split(":")[0]
        role_dir = tmp_path / folder.removeprefix("./")
        named = [v for v in [*svc.get("environment", {}).values(), *svc.get("command", [])]
                 if str(v).startswith("/secrets/")]
        named += [v.split("ssl_ca_certs=")[1] for v in svc.get("environment", {}).values()
                  if "ssl_ca_certs=" in str(v)]
        assert named, name
        for path in named:
            assert (role_dir / path.removeprefix("/secrets/")).is_file(), (name, path)
        for env_file in svc.get("env_file", []):
            assert (tmp_path / env_file.removeprefix("./")).is_file(), (name, env_file)


def test_dockerfile_runs_as_a_non_root_user():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert "useradd --uid 10001" in text and users[-1].startswith("10001")  # k8s: runAsUser 10001


def test_dockerfile_copies_what_exists_and_installs_the_package():
    text = (ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    assert "pip install ." in text and "torch==2.13.0" in text


def test_health_subcommand(stack):
    ok = subprocess.run([sys.executable, "-m", "launcher.cli", "health", stack.addresses["orch"]],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    from specdec.runtime.procs import free_port

    dead = subprocess.run([sys.executable, "-m", "launcher.cli", "health", f"127.0.0.1:{free_port()}",
                           "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "UNAVAILABLE" in dead.stderr


def test_compose_redis_keeps_sessions_across_a_restart():
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    redis = spec["services"]["redis"]
    command = " ".join(redis["command"])  # a plain argv or a shell line
    assert "--appendonly yes" in command and "--appendonly no" not in command
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in spec["volumes"]

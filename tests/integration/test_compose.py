"""compose.yaml, the Dockerfile and .dockerignore, checked offline.

compose.yaml validates against the Compose specification and says what the issue asks: GPU and CPU
profiles, TLS on every hop with each container holding its own role's secrets, the gateway, the
orchestrator with `specdec up`'s defaults, each role's model from a folder or a Hugging Face id,
and model replicas that advertise their own container's name (so --scale works), which the
certificates `specdec secrets` writes by default cover. The Dockerfile is multi-stage, runs as a
non-root user, has a HEALTHCHECK, copies every package the processes import; .dockerignore keeps
secrets, .venv and .git out of the build context.
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _spec() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


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


def _copied(text: str) -> list[str]:
    """The sources of the Dockerfile's COPY lines from the build context (not --from a stage)."""
    sources = []
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        words = [w for w in line.split() if not w.startswith("--")]
        if not line.startswith("--from"):
            sources += words[:-1]
    return sources


def test_dockerfile_copies_what_exists_and_installs_the_package():
    text = (ROOT / "Dockerfile").read_text()
    for src in _copied(text):
        if "[" in src:  # a glob for what may be absent: the air-gapped build's wheelhouse
            assert src.startswith("build/wheelhous[e]"), src
            continue
        assert (ROOT / src).exists(), src
    assert "pip install ." in text and "torch==2.13.0" in text
    assert "--no-index --find-links /wheelhouse" in text  # the wheelhouse, where there is one


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


# ------------------------------------------------------------------- the image


def _stages(text: str) -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per FROM."""
    joined = re.sub(r"\\\n\s*(#[^\n]*\n\s*)*", " ", text)
    stages: list[list[str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_builds_in_one_stage_and_runs_from_a_slim_one():
    stages = _stages((ROOT / "Dockerfile").read_text())
    assert len(stages) >= 2
    builder, runtime = stages[0], stages[-1]
    name = builder[0].split(" AS ")[1].strip()
    # CPU or CUDA torch by build argument, installed in the builder; the package built there too.
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in builder
    assert any('--index-url "${TORCH_INDEX_URL}" torch==2.13.0' in line for line in builder)
    assert any("pip install ." in line for line in builder)
    # The runtime stage: the builder's environment, no build, no source tree, not root.
    assert any(line.startswith(f"COPY --from={name} /opt/specdec /opt/specdec") for line in runtime)
    assert not any("pip install" in line for line in runtime)
    assert not any(line.startswith("COPY ") and "--from" not in line for line in runtime)
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert runtime[0].split()[1] == builder[0].split()[1] == "${PYTHON_IMAGE}"  # the same Python
    health = [line for line in runtime if line.startswith("HEALTHCHECK ")]
    assert len(health) == 1 and '"python", "-m", "launcher.healthcheck"' in health[0]
    assert (ROOT / "launcher" / "healthcheck.py").is_file()


def test_dockerfile_copies_every_package_the_processes_import():
    """pyproject's packages, but for training (distill/), which stays out of the image."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include} - {"distill"}
    copied = set(_copied((ROOT / "Dockerfile").read_text()))
    assert packages <= copied, packages - copied
    assert {"pyproject.toml", "README.md", "LICENSE"} <= copied


def _dockerignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _dockerignore_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negated
    return excluded


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_keeps_secrets_venv_and_git_out_and_what_the_image_copies_in():
    patterns = _dockerignore()
    for path in ("secrets/orchestrator/ca.key", "secrets/ca.key", "secrets/target/model.env",
                 "deploy/k8s/secrets/orchestrator/client.key", "deploy/k8s/secrets/state.json",
                 ".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/__init__.py",
                 ".git/config", ".git/objects/ab/cdef", "tests/test_deploy.py", ".pytest_cache/v/x",
                 "benchmarks/results/x.json", "specdec.egg-info/PKG-INFO", ".env",
                 "specdec/__pycache__/x.cpython-311.pyc", "engine/model/__pycache__/llama.cpython-311.pyc",
                 "specdec/runtime/secrets/ca.key", "launcher/server.key"):
        assert dockerignored(path, patterns), path
    for pattern in ("*", "!specdec/", "**/__pycache__"):  # the matcher follows Docker's rules
        assert dockerignored("x/__pycache__/y", [pattern]) == (pattern != "!specdec/")
    copied = _copied((ROOT / "Dockerfile").read_text())
    tracked = subprocess.run(["git", "ls-files", *copied], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split() if (ROOT / ".git").exists() else copied
    assert tracked
    for path in tracked:
        assert not dockerignored(path, patterns), path


# ------------------------------------------------------------------- compose: the deployment


def _interpolated(value) -> tuple[str | None, str | None]:
    """("VAR", default) for "${VAR:-default}", (None, value) for a literal."""
    match = re.fullmatch(r"\$\{([A-Z_][A-Z0-9_]*):-([^}]*)\}", str(value)) if value is not None else None
    return (match[1], match[2]) if match else (None, value)


def _script(svc: dict) -> str:
    command = svc["command"]
    assert command[:2] == ["sh", "-c"], command
    return command[2].replace("$$", "$")  # compose's escape of a literal $


def _argv(svc: dict) -> list[str]:
    if svc["command"][:2] == ["sh", "-c"]:
        script = _script(svc)
        assert script.startswith("exec "), script
        return shlex.split(script.removeprefix("exec "))
    return svc["command"]


def _advertised(svc: dict, hostname: str) -> str:
    """The --advertise-address the container's shell computes, with this container hostname."""
    script = _script(svc).replace("exec python", "echo python", 1)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10, check=True,
                         env={"PATH": os.environ["PATH"], "HOSTNAME": hostname})
    words = out.stdout.split()
    return words[words.index("--advertise-address") + 1]


def test_every_model_replica_advertises_its_own_container():
    """--scale: each replica registers <its hostname>.<its role's network>:PORT, which Docker's DNS
    answers on that network (joined by the service and the orchestrator), never a name shared by
    the replicas (a service name would round-robin between them and break session affinity)."""
    spec = _spec()
    services = spec["services"]
    networks = {key: (net or {}).get("name", key) for key, net in spec["networks"].items()}
    orchestrator_networks = {networks[n] for n in services["orchestrator"]["networks"]}
    for name in MODEL_SERVICES:
        svc, role = services[name], name.removesuffix("-cpu")
        assert "SPECDEC_ADVERTISE_ADDRESS" not in svc["environment"], name
        first, second = _advertised(svc, "0123456789ab"), _advertised(svc, "ba9876543210")
        assert first == f"0123456789ab.{role}.specdec:{svc['environment']['SPECDEC_PORT']}", name
        assert second.startswith("ba9876543210."), name
        domain = first.split(":")[0].split(".", 1)[1]
        assert domain in {networks[n] for n in svc["networks"]} and domain in orchestrator_networks, name
        assert "default" in svc["networks"], name  # Redis
        assert "--advertise-address" in _help(_argv(svc)[2])
    for name in ("redis", "gateway"):  # no business on the model services' networks
        assert services[name].get("networks", ["default"]) == ["default"], name


def _handshake(port: int, name: str, client: Path) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials = grpc.ssl_channel_credentials((client / "ca.crt").read_bytes(), (client / "client.key").read_bytes(),
                                               (client / "client.crt").read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                             options=[("grpc.ssl_target_name_override", name)]) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return True
        except grpc.RpcError:
            return False


def test_default_certificates_cover_every_name_compose_dials_and_no_other_roles(tmp_path):
    """`specdec secrets ./secrets` (no --host): a real TLS handshake, checked as grpc checks it, for
    each name compose dials a server role by: the orchestrator (the gateway's SPECDEC_ORCHESTRATOR)
    and each model replica's advertised name; another role's name fails."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from specdec.runtime.credentials import generate

    generate(tmp_path / "secrets")
    services = _spec()["services"]
    dialed = {"orchestrator": {services["gateway"]["environment"]["SPECDEC_ORCHESTRATOR"].rsplit(":", 1)[0]},
              "target": set(), "draft": set()}
    for name in MODEL_SERVICES:
        dialed[name.removesuffix("-cpu")].add(_advertised(services[name], "0123456789ab").rsplit(":", 1)[0])
    for role, names in dialed.items():
        own = tmp_path / "secrets" / role
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [((own / "server.key").read_bytes(), (own / "server.crt").read_bytes())],
            root_certificates=(own / "ca.crt").read_bytes(), require_client_auth=True))
        server.start()
        try:
            for name in sorted(names):
                assert _handshake(port, name, tmp_path / "secrets" / "orchestrator"), (role, name)
            for name in sorted(set().union(*(n for r, n in dialed.items() if r != role))):
                assert not _handshake(port, name, tmp_path / "secrets" / "orchestrator"), (role, name)
        finally:
            server.stop(None)


def test_compose_gateway_in_front_of_the_orchestrator():
    services = _spec()["services"]
    gateway, orchestrator = services["gateway"], services["orchestrator"]
    env = gateway["environment"]
    assert gateway["command"] == ["python", "-m", "gateway"]
    host, port = env["SPECDEC_ORCHESTRATOR"].rsplit(":", 1)
    assert host == "orchestrator" and port == orchestrator["environment"]["SPECDEC_PORT"]
    assert env["SPECDEC_TLS_CA"] == "/secrets/ca.crt"  # from ./secrets/gateway: the CA alone
    assert not any("TOKEN" in k for k in env)  # each caller's own bearer token is passed on
    assert gateway["depends_on"] == {"orchestrator": {"condition": "service_healthy"}}
    assert all(p.startswith("127.0.0.1:") and p.endswith(f":{env['SPECDEC_PORT']}") for p in gateway["ports"])
    assert env["SPECDEC_METRICS_PORT"] != env["SPECDEC_PORT"]
    test = gateway["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and f"http://127.0.0.1:{env['SPECDEC_PORT']}/health" in test[3]
    text = _help("gateway")
    for name in env:
        assert name in text, name


def test_the_orchestrator_runs_with_the_defaults_of_specdec_up():
    """The combined proposer, k chosen per round, the speculation gate: as `specdec up` starts it,
    in compose (overridable) and on Kubernetes."""
    from launcher.cli import LAUNCH

    up = {f.name: f.default for f in LAUNCH.flags}
    env = _spec()["services"]["orchestrator"]["environment"]
    assert _interpolated(env["SPECDEC_DEFAULT_PROPOSER"])[1] == up["default-proposer"] == "combined"
    assert _interpolated(env["SPECDEC_DEFAULT_K"])[1] == up["default-k"] == "auto"
    assert _interpolated(env["SPECDEC_SPECULATION_GATE"])[1] == "on"
    assert re.search(r"--speculation-gate, --no-speculation-gate\s[^[]*\[SPECDEC_SPECULATION_GATE\]\s*\(default:\s*on\)",
                     _help("orchestrator"))
    k8s = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/base/orchestrator.yaml").read_text())
           if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    k8s_env = {e["name"]: e.get("value") for e in k8s["env"]}
    assert k8s_env["SPECDEC_DEFAULT_PROPOSER"] == up["default-proposer"]
    assert k8s_env["SPECDEC_DEFAULT_K"] == up["default-k"]
    assert k8s_env.get("SPECDEC_SPECULATION_GATE", "on") == "on"


def test_each_model_role_takes_a_folder_or_a_hugging_face_id():
    """SPECDEC_TARGET_MODEL / SPECDEC_DRAFT_MODEL (and their revisions) per role; a folder under
    /models, from SPECDEC_MODELS_DIR (a host folder or the named volume), or an id fetched into the
    role's own cache volume (no other role writes it), where the orchestrator reads the target's
    tokenizer offline, read-only."""
    spec = _spec()
    services = spec["services"]
    orchestrator = services["orchestrator"]
    for name in MODEL_SERVICES:
        role, env = name.removesuffix("-cpu"), services[name]["environment"]
        assert _interpolated(env["SPECDEC_MODEL"]) == (f"SPECDEC_{role.upper()}_MODEL", ""), name
        assert _interpolated(env["SPECDEC_REVISION"]) == (f"SPECDEC_{role.upper()}_REVISION", "main"), name
        assert _interpolated(env["HF_HUB_OFFLINE"]) == ("HF_HUB_OFFLINE", "0"), name  # fetches, unless told
        assert "HF_TOKEN" in env and env["HF_TOKEN"] is None, name  # passed through from the host only
        volumes = services[name]["volumes"]
        assert any(v.startswith("${SPECDEC_MODELS_DIR:-./models}:/models:ro") for v in volumes), name
        assert env["HF_HOME"].startswith("/cache/") and f"{role}-cache:/cache" in volumes, name
    env = orchestrator["environment"]
    target = services["target-cpu"]["environment"]
    assert _interpolated(env["SPECDEC_TOKENIZER"]) == _interpolated(target["SPECDEC_MODEL"])
    assert _interpolated(env["SPECDEC_TOKENIZER_REVISION"]) == _interpolated(target["SPECDEC_REVISION"])
    assert env["HF_HOME"] == target["HF_HOME"] and "target-cache:/cache:ro" in orchestrator["volumes"]
    assert env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env  # the target fetched it first
    assert orchestrator["depends_on"]["target-cpu"]["condition"] == "service_healthy"
    assert "models" in spec["volumes"]  # SPECDEC_MODELS_DIR=models


@functools.cache
def _help(module: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_every_compose_setting_exists_in_the_processes_help():
    """Read by the container's process, or by `specdec health`, its health check."""
    health = subprocess.run([sys.executable, "-c", "import sys; from launcher.cli import main; "
                             "sys.exit(main(['health', '--help']))"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True).stdout
    for name, svc in _spec()["services"].items():
        if svc.get("image") != "specdec:latest":
            continue
        argv = _argv(svc)
        assert argv[:2] == ["python", "-m"], (name, argv)
        text = _help(argv[2]) + health
        for key in svc["environment"]:
            if key.startswith("SPECDEC_"):
                assert re.search(rf"\[{key}\]", text), f"{name}: {key} not in python -m {argv[2]} --help"
        for arg in argv[3:]:
            if arg.startswith("--"):
                assert re.search(rf"\s{re.escape(arg)}\b", text), (name, arg)

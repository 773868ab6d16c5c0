"""deploy/: the Kubernetes manifests (base + overlays, rendered here) and the Grafana dashboard.

Offline: every rendered manifest validates strictly against the Kubernetes schemas that
`kubernetes-validate` ships; probes target the ports the processes listen on; every
SPECDEC_* name and flag used exists in the processes' own --help; grace periods cover
the drain; every hop is TLS with tokens from the Secrets that deploy/k8s/secrets generates
(rendered here from a fresh `specdec secrets` folder made with the recipe's --host names).
The live check of the dashboard's metric names is in tests/integration/test_gateway.py.
"""
from __future__ import annotations

import atexit
import base64
import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": "base", "cpu": "overlays/cpu", "gpu": "overlays/gpu"}
ROLES = ("target", "draft", "orchestrator", "gateway")
SECRETS = K8S / "secrets"  # only its kustomization.yaml is committed

# ------------------------------------------------------------------- rendering

# Strategic-merge keys of the lists the overlays patch (everything else is replaced).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "volumeMounts": "mountPath", "ports": "containerPort"}


def _merge(base, patch, field: str = ""):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    key = _MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        out = [copy.deepcopy(item) for item in base]
        for item in patch:
            match = next((i for i, old in enumerate(out) if old.get(key) == item.get(key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = _merge(out[match], item)
        return out
    return copy.deepcopy(patch)


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def recipe_hosts() -> list[str]:
    """The --host names of the `specdec secrets` recipe in deploy/k8s/secrets/kustomization.yaml."""
    text = (SECRETS / "kustomization.yaml").read_text()
    lines = [line.lstrip("# ").rstrip("\\ ") for line in text.splitlines()]
    recipe = " ".join(line for line in lines
                      if line.startswith("specdec secrets deploy/k8s/secrets") or line.startswith("--host"))
    words = shlex.split(recipe)
    hosts = [words[i + 1] for i, w in enumerate(words) if w == "--host"]
    assert hosts, "no --host in the recipe"
    return hosts


@functools.cache
def workdir() -> Path:
    """deploy/k8s copied, with deploy/k8s/secrets filled by `specdec secrets` (the recipe's hosts)."""
    from specdec.credentials import generate

    root = Path(tempfile.mkdtemp(prefix="specdec-k8s-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copytree(K8S, root / "k8s", ignore=lambda d, names: [
        n for n in names if Path(d).resolve() == SECRETS and n != "kustomization.yaml"])
    generate(root / "k8s" / "secrets", hosts=recipe_hosts())
    return root / "k8s"


def _generate_secrets(folder: Path, spec: dict) -> list[dict]:
    """kustomize's secretGenerator (files: key = file name; envs: KEY=VALUE lines)."""
    options = spec.get("generatorOptions", {})
    if spec.get("secretGenerator"):
        assert options.get("disableNameSuffixHash"), "the manifests name the Secrets without a hash"
    docs = []
    for gen in spec.get("secretGenerator", []):
        data: dict[str, bytes] = {}
        for entry in gen.get("files", []):
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = (folder / path).read_bytes()
        for path in gen.get("envs", []):
            for line in (folder / path).read_text().splitlines():
                if line.strip() and not line.startswith("#"):
                    key, _, value = line.partition("=")
                    data[key.strip()] = value.encode()
        metadata = {"name": gen["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
                     "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})
    return docs


def render(folder: Path) -> list[dict]:
    """The subset of kustomize these files use: resources, namespace, patches (by kind + name),
    secretGenerator."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        docs += render(path) if path.is_dir() else _load(path)
    docs += _generate_secrets(folder, spec)
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = spec["namespace"]
    for entry in spec.get("patches", []):
        for patch in _load(folder / entry["path"]):
            hits = [i for i, d in enumerate(docs) if d["kind"] == patch["kind"]
                    and d["metadata"]["name"] == patch["metadata"]["name"]]
            assert len(hits) == 1, f"patch {entry['path']} matches {len(hits)} resources"
            docs[hits[0]] = _merge(docs[hits[0]], patch)
    return docs


@functools.cache
def rendered(name: str) -> tuple[dict, ...]:
    return tuple(render(workdir() / KUSTOMIZATIONS[name]))


def _find(docs, kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def _container(docs, role: str) -> dict:
    pod = _find(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == role)


def _env(container: dict, docs) -> dict[str, str]:
    """The container's environment: envFrom ConfigMaps/Secrets, then its own env (which wins)."""
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            env.update(_secret_data(_find(docs, "Secret", source["secretRef"]["name"])))
    env.update({e["name"]: e.get("value", "") for e in container.get("env", [])})
    return env


def _secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    data.update(secret.get("stringData", {}))
    return data


def _command(container: dict) -> list[str]:
    """argv of the process: `sh -c 'exec python -m ...'` is split like the shell would (roughly)."""
    command = [*container["command"], *container.get("args", [])]
    if command[:2] == ["sh", "-c"]:
        assert command[2].startswith("exec "), command
        return shlex.split(command[2].removeprefix("exec "))
    return command


def _mounted_files(docs, pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """{path in the container: (Secret name, key)} for every Secret file the container mounts."""
    def secret_files(source: dict) -> dict[str, str]:  # {relative path: key}
        name = source.get("secretName") or source["name"]
        keys = _secret_data(_find(docs, "Secret", name))
        if "items" in source:
            assert all(item["key"] in keys for item in source["items"]), name
            return {item["path"]: item["key"] for item in source["items"]}
        return {key: key for key in keys}

    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = ([volume["secret"]] if "secret" in volume else
                   [s["secret"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s])
        for source in sources:
            name = source.get("secretName") or source["name"]
            for rel, key in secret_files(source).items():
                files[f"{mount['mountPath'].rstrip('/')}/{rel}"] = (name, key)
    return files


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_python_rendering_matches_kubectl_kustomize(name):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the Python rendering is what the other tests check)")
    out = subprocess.run([kubectl, "kustomize", str(workdir() / KUSTOMIZATIONS[name])],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"kubectl kustomize unavailable: {out.stderr.strip()[:200]}")
    theirs = {(d["kind"], d["metadata"]["name"]): _sorted(_decoded(d))
              for d in yaml.safe_load_all(out.stdout) if d}
    ours = {(d["kind"], d["metadata"]["name"]): _sorted(_decoded(d)) for d in rendered(name)}
    assert ours == theirs


def _decoded(doc: dict) -> dict:
    """A Secret's data decoded (kustomize wraps the base64 lines)."""
    if doc["kind"] != "Secret":
        return doc
    return {**doc, "data": _secret_data(doc)}


def _sorted(node, field: str = ""):
    """Merge-keyed lists in key order: kustomize puts patched entries first."""
    if isinstance(node, dict):
        return {k: _sorted(v, k) for k, v in node.items()}
    if isinstance(node, list):
        items = [_sorted(v) for v in node]
        key = _MERGE_KEYS.get(field)
        return sorted(items, key=lambda i: str(i.get(key))) if key else items
    return node


# ------------------------------------------------------------------- schemas


def _all_manifests():
    for name in KUSTOMIZATIONS:
        for doc in rendered(name):
            yield name, doc
    for path in sorted((K8S / "examples").glob("*.yaml")):
        for doc in _load(path):
            yield f"examples/{path.name}", doc


def test_every_manifest_validates_against_the_kubernetes_schemas():
    version = kubernetes_validate.latest_version()
    count = 0
    for where, doc in _all_manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} "
                        f"at {list(exc.path)}")
        count += 1
    assert count >= 3 * 17


def test_the_validator_rejects_a_broken_manifest():
    deployment = copy.deepcopy(_find(rendered("base"), "Deployment", "specdec-target"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSeconds"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


# ------------------------------------------------------------------- roles, ports, probes


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_probes_target_the_ports_the_processes_listen_on(name):
    docs = rendered(name)
    for role in ROLES:
        container = _container(docs, role)
        env = _env(container, docs)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if role == "gateway":
            assert ports["http"] == int(env["SPECDEC_PORT"])
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["port"] in ("http", ports["http"])
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            continue
        assert ports["grpc"] == int(env["SPECDEC_PORT"]), role
        assert ports["metrics"] == int(env["SPECDEC_METRICS_PORT"]), role
        assert env["SPECDEC_METRICS_HOST"] == "0.0.0.0", role  # scraped from outside the pod
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # grpc.health.v1 over TLS (test_probes_speak_tls checks the credentials)
            command = container[probe]["exec"]["command"]
            assert command[:2] == ["specdec", "health"], (role, probe)
            assert command[-1] == f"127.0.0.1:{ports['grpc']}", (role, probe)
        if role in ("target", "draft"):
            assert _advertise_address(container).endswith(f":{ports['grpc']}")
            assert env["SPECDEC_REDIS_URL"]  # replicas register for discovery


def _advertise_address(container: dict, pod_ip: str = "10.244.1.7", namespace: str = "specdec") -> str:
    """The --advertise-address a model replica registers, as its shell computes it."""
    command = container["command"]
    assert command[:2] == ["sh", "-c"], command
    script = command[2].replace("exec python", "echo python", 1)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10, check=True,
                         env={"PATH": os.environ["PATH"], "POD_IP": pod_ip, "POD_NAMESPACE": namespace})
    words = out.stdout.split()
    return words[words.index("--advertise-address") + 1]


def test_services_and_budgets_select_existing_pods():
    docs = rendered("base")
    labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
              for d in docs if d["kind"] in ("Deployment", "StatefulSet")}

    def selects(selector: dict) -> list[str]:
        return [n for n, lab in labels.items() if all(lab.get(k) == v for k, v in selector.items())]

    for doc in docs:
        if doc["kind"] == "Service":
            assert len(selects(doc["spec"]["selector"])) == 1, doc["metadata"]["name"]
        if doc["kind"] == "PodDisruptionBudget":
            assert selects(doc["spec"]["selector"]["matchLabels"]) == [doc["metadata"]["name"]]
    # Model services are discovered per pod: headless.
    for role in ("target", "draft"):
        assert _find(docs, "Service", f"specdec-{role}")["spec"]["clusterIP"] == "None"
    assert _find(docs, "StatefulSet", "redis")["spec"]["serviceName"] == "redis"
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"} == {
        f"specdec-{r}" for r in ROLES}
    # The gateway reaches the orchestrators' Service.
    service = _find(docs, "Service", "specdec-orchestrator")
    host, port = _env(_container(docs, "gateway"), docs)["SPECDEC_ORCHESTRATOR"].split(":")
    assert host == service["metadata"]["name"]
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]


def test_hpa_examples_scale_existing_deployments_on_an_exported_gauge():
    base = rendered("base")
    source = (ROOT / "engine/metrics.py").read_text()
    for doc in _load(K8S / "examples/hpa.yaml"):
        _find(base, "Deployment", doc["spec"]["scaleTargetRef"]["name"])
        for metric in doc["spec"]["metrics"]:
            assert f'"{metric["pods"]["metric"]["name"]}"' in source


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_devices_and_gpu_requests(name):
    docs = rendered(name)
    for role in ROLES:
        container = _container(docs, role)
        pod = _find(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if name == "gpu" and role in ("target", "draft"):
            assert gpus == 1
            assert _env(container, docs)["SPECDEC_DEVICE"].startswith("cuda")
            assert pod["nodeSelector"] == {"specdec/pool": role}
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        else:
            assert gpus is None and "nodeSelector" not in pod
            if role in ("target", "draft"):
                assert _env(container, docs)["SPECDEC_DEVICE"] == "cpu"


# ------------------------------------------------------------------- names from --help


@functools.cache
def _help(module: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _module(container: dict) -> str:
    command = _command(container)
    assert command[:2] == ["python", "-m"], command
    return command[2]


def test_every_setting_and_flag_exists_in_the_processes_help():
    docs = rendered("gpu")  # a superset of the base's names
    known_anywhere = set()
    for role in ROLES:
        container = _container(docs, role)
        text = _help(_module(container))
        known = set(re.findall(r"\bSPECDEC_[A-Z_]+\b", text))
        known_anywhere |= known
        for entry in container.get("env", []):
            if entry["name"].startswith("SPECDEC_"):
                assert entry["name"] in known, f"{role}: {entry['name']} not in {_module(container)} --help"
        for arg in _command(container)[3:]:
            if arg.startswith("--"):
                assert re.search(rf"\s{re.escape(arg)}\b", text), f"{role}: {arg} not in --help"
    shared = dict(_find(docs, "ConfigMap", "specdec-config")["data"])
    shared.update(_secret_data(_find(docs, "Secret", "specdec-secrets")))
    # Read by the Redis client of every server (specdec/store.py), not a flag.
    known_anywhere.add("SPECDEC_REDIS_PASSWORD")
    assert '"SPECDEC_REDIS_PASSWORD"' in (ROOT / "specdec/store.py").read_text()
    for name in shared:
        assert name in known_anywhere, f"{name} is read by no process"


def test_grace_periods_cover_pre_stop_and_drain():
    for name in KUSTOMIZATIONS:
        docs = rendered(name)
        for role in ROLES:
            pod = _find(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]
            container = _container(docs, role)
            drain = float(_env(container, docs)["SPECDEC_GRACE"])
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 1, (name, role)
            assert "--grace" in _help(_module(container))


# ------------------------------------------------------------------- security

MODEL_TLS = {"SPECDEC_TLS_CERT": "server.crt", "SPECDEC_TLS_KEY": "server.key",
             "SPECDEC_TLS_CLIENT_CA": "ca.crt"}  # mutual TLS
ORCHESTRATOR_TLS = {"SPECDEC_TLS_CERT": "server.crt", "SPECDEC_TLS_KEY": "server.key",
                    "SPECDEC_AUTH_TOKENS": "tokens", "SPECDEC_SERVICE_TLS_CA": "ca.crt",
                    "SPECDEC_SERVICE_TLS_CERT": "client.crt", "SPECDEC_SERVICE_TLS_KEY": "client.key"}


def _pod(docs, role: str) -> dict:
    return _find(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]


def _file_setting(docs, role: str, name: str, key: str) -> None:
    """`name` is set, in the container's env and in its --help, to a mounted file holding `key`."""
    container = _container(docs, role)
    path = _env(container, docs).get(name)
    assert path, f"{role}: {name} not set"
    assert name in _help(_module(container)), f"{role}: {name} not in --help"
    files = _mounted_files(docs, _pod(docs, role), container)
    assert path in files, f"{role}: {name}={path} is not a mounted Secret file"
    assert files[path][1] == key, (role, name, files[path])


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_nothing_runs_insecure(name):
    text = yaml.safe_dump_all(list(rendered(name)))
    assert "SPECDEC_INSECURE" not in text and "--insecure" not in text
    docs = rendered(name)
    for role in ("target", "draft", "orchestrator"):
        env = _env(_container(docs, role), docs)
        assert env["SPECDEC_HOST"] == "0.0.0.0"  # so the bind check needs TLS/tokens, and has them
        assert env["SPECDEC_REDIS_URL"].startswith("rediss://"), role
        assert "@" not in env["SPECDEC_REDIS_URL"], "the password comes from SPECDEC_REDIS_PASSWORD"
        assert env["SPECDEC_REDIS_PASSWORD"], role


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_model_services_require_mutual_tls_and_the_service_token(name):
    docs = rendered(name)
    token = _secret_data(_find(docs, "Secret", "specdec-secrets"))["SPECDEC_SERVICE_TOKEN"]
    for role in ("target", "draft"):
        container = _container(docs, role)
        for setting, key in MODEL_TLS.items():
            _file_setting(docs, role, setting, key)
        assert all(secret == "specdec-tls" for secret, _ in
                   _mounted_files(docs, _pod(docs, role), container).values())
        assert "SPECDEC_SERVICE_TOKEN" in _help(_module(container))
        assert _env(container, docs)["SPECDEC_SERVICE_TOKEN"] == token  # envFrom specdec-secrets
    # The orchestrator presents what the services require.
    for setting, key in ORCHESTRATOR_TLS.items():
        _file_setting(docs, "orchestrator", setting, key)
    assert _env(_container(docs, "orchestrator"), docs)["SPECDEC_SERVICE_TOKEN"] == token


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_tenant_tokens_and_the_gateway(name):
    docs = rendered(name)
    files = _mounted_files(docs, _pod(docs, "orchestrator"), _container(docs, "orchestrator"))
    path = _env(_container(docs, "orchestrator"), docs)["SPECDEC_AUTH_TOKENS"]
    assert files[path] == ("specdec-tokens", "tokens")
    from specdec.security import TokenTable

    assert TokenTable.from_file(workdir() / "secrets" / "tokens").tenants  # what specdec secrets writes
    # The gateway dials the orchestrator with TLS; it holds no token of its own (it has no
    # such setting): each caller's Authorization header is passed on.
    gateway = _container(docs, "gateway")
    assert not re.search(r"--([a-z]+-)*token\b|SPECDEC_([A-Z]+_)*TOKEN\b", _help("gateway"))
    _file_setting(docs, "gateway", "SPECDEC_TLS_CA", "ca.crt")
    assert set(_mounted_files(docs, _pod(docs, "gateway"), gateway).values()) == {("specdec-tls", "ca.crt")}
    assert "/secrets/ca.crt" in _env(gateway, docs)["SPECDEC_REDIS_URL"]  # the same CA everywhere


@functools.cache
def _health_help() -> str:
    # `specdec` is the console script of specdec.cli:main (pyproject.toml).
    out = subprocess.run([sys.executable, "-c", "import sys; from specdec.cli import main; "
                          "sys.exit(main(['health', '--help']))"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_probes_speak_tls(name):
    """Native grpc: probes have no TLS: every gRPC server's probes exec `specdec health` with
    the CA (and a client certificate where the server requires one), all of it mounted."""
    docs = rendered(name)
    flags = set(re.findall(r"--[a-z-]+", _health_help()))
    for role in ("target", "draft", "orchestrator"):
        container = _container(docs, role)
        env = _env(container, docs)
        files = _mounted_files(docs, _pod(docs, role), container)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in container[probe], (role, probe)
            assert container[probe]["timeoutSeconds"] >= 3, (role, probe)  # a Python process
            args = container[probe]["exec"]["command"][2:]
            options = dict(zip(args[:-1:2], args[1:-1:2]))
            assert set(options) <= flags, (role, options)
            assert files[options["--tls-ca"]][1] == "ca.crt"
            if env.get("SPECDEC_TLS_CLIENT_CA"):
                assert files[options["--client-cert"]][1] == "client.crt"
                assert files[options["--client-key"]][1] == "client.key"


def test_secrets_come_from_git_ignored_files():
    spec = yaml.safe_load((SECRETS / "kustomization.yaml").read_text())
    written = {p.name for p in (workdir() / "secrets").iterdir()} - {"kustomization.yaml"}
    used = set()
    for gen in spec["secretGenerator"]:
        used |= {f.rpartition("=")[2] for f in [*gen.get("files", []), *gen.get("envs", [])]}
    assert used <= written, used - written  # every file is one `specdec secrets` writes
    assert "ca.key" not in used  # the CA's key never enters the cluster
    readme = (ROOT / "README.md").read_text()
    assert all(f"--host {h}" in readme or f"--host '{h}'" in readme for h in recipe_hosts())
    if shutil.which("git") and (ROOT / ".git").exists():
        for name in written:
            path = f"deploy/k8s/secrets/{name}"
            assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
        assert subprocess.run(["git", "check-ignore", "-q", "deploy/k8s/secrets/kustomization.yaml"],
                              cwd=ROOT).returncode == 1


def test_the_certificate_covers_every_name_dialed():
    """A real TLS handshake per name the processes dial, checked as grpc checks it, with the
    server certificate the recipe's --host names give."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    docs = rendered("base")
    names = {"127.0.0.1"}  # the probes
    names.add(_env(_container(docs, "gateway"), docs)["SPECDEC_ORCHESTRATOR"].rsplit(":", 1)[0])
    names.add(re.match(r"rediss://([^:/]+)", _env(_container(docs, "target"), docs)["SPECDEC_REDIS_URL"])[1])
    for role in ("target", "draft"):
        names.add(_advertise_address(_container(docs, role)).rsplit(":", 1)[0])
        names.add(_advertise_address(_container(docs, role), pod_ip="10.0.255.3").rsplit(":", 1)[0])
    secrets = workdir() / "secrets"
    read = lambda n: (secrets / n).read_bytes()  # noqa: E731
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(read("server.key"), read("server.crt"))], root_certificates=read("ca.crt"),
        require_client_auth=True))
    server.start()
    try:
        def handshake(name: str) -> bool:
            credentials = grpc.ssl_channel_credentials(read("ca.crt"), read("client.key"), read("client.crt"))
            with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                                     options=[("grpc.ssl_target_name_override", name)]) as channel:
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return True
                except grpc.RpcError:
                    return False

        for name in sorted(names):
            assert handshake(name), f"the server certificate does not cover {name}"
        assert not handshake("10.244.1.7")  # why replicas advertise a DNS name, not their pod IP
    finally:
        server.stop(None)


# ------------------------------------------------------------------- dashboard


def test_grafana_dashboard_is_well_formed():
    dashboard = json.loads((ROOT / "deploy/grafana/specdec.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert re.search(r"\bspecdec_[a-z_]+", target["expr"]), target["expr"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        assert panel["datasource"]["uid"] == "${datasource}"
    titles = " ".join(p["title"].lower() for p in graphs)
    for topic in ("tokens / s", "acceptance", "passes per token", "cache", "errors", "round"):
        assert topic in titles or topic in json.dumps(dashboard).lower(), topic

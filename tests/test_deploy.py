"""deploy/: the Kubernetes manifests (base + overlays + components, rendered here) and the Grafana dashboard.

Offline: every rendered manifest validates strictly against the Kubernetes schemas that
`kubernetes-validate` ships, and every pod spec meets the restricted Pod Security Standard;
probes target the ports the processes listen on; every SPECDEC_* name and flag used exists
in the processes' own --help; grace periods cover the drain; every hop is TLS with tokens
from the Secrets that deploy/k8s/secrets generates (rendered here from a fresh `specdec
secrets` folder made with the recipe's --host names), each pod mounting only its own role's;
NetworkPolicies let only orchestrators reach the model services. Each role's model comes from
the specdec-models ConfigMap: a folder on a volume (components/model-pvc) or a Hugging Face id
fetched by an init container into the cache the process then reads offline (components/model-hub,
with its egress policy); overlays/user-model fills it in, and a rendering made here mixes both.
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
KUSTOMIZATIONS = {"base": "base", "cpu": "overlays/cpu", "gpu": "overlays/gpu",
                  "user-model": "overlays/user-model", "mixed": "overlays/test-mixed"}
GPU_KUSTOMIZATIONS = {"gpu", "mixed"}
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
    from specdec.runtime.credentials import generate

    root = Path(tempfile.mkdtemp(prefix="specdec-k8s-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copytree(K8S, root / "k8s", ignore=lambda d, names: [
        n for n in names if Path(d).resolve() == SECRETS and n != "kustomization.yaml"])
    generate(root / "k8s" / "secrets", hosts=recipe_hosts())
    _write_mixed_overlay(root / "k8s" / "overlays" / "test-mixed")
    return root / "k8s"


# One role from the Hub, the other from the volume: both components at once, on the GPU overlay.
MIXED_MODELS = {"target": "Qwen/Qwen2.5-1.5B-Instruct", "target-revision": "v1.0",
                "draft": "/models/qwen-draft", "draft-revision": "main"}


def _write_mixed_overlay(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../gpu"],
        "components": ["../../components/model-pvc", "../../components/model-hub"],
        "patches": [{"path": "models.yaml"}]}))
    (folder / "models.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "specdec-models"},
        "data": MIXED_MODELS}))


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


def render(folder: Path, docs: list[dict] | None = None) -> list[dict]:
    """The subset of kustomize these files use: resources, components, namespace, patches (by
    kind + name), secretGenerator. A Component works on `docs`, what its parent has accumulated."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = [] if docs is None else docs
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        docs += render(path) if path.is_dir() else _load(path)
    for entry in spec.get("components", []):
        path = (folder / entry).resolve()
        assert yaml.safe_load((path / "kustomization.yaml").read_text())["kind"] == "Component", entry
        docs = render(path, docs)
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
    """The container's environment: envFrom ConfigMaps/Secrets, then its own env (which wins), a
    ConfigMap's key as its value (valueFrom configMapKeyRef; other valueFrom: "")."""
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            env.update(_secret_data(_find(docs, "Secret", source["secretRef"]["name"])))
    for entry in container.get("env", []):
        ref = entry.get("valueFrom", {}).get("configMapKeyRef")
        env[entry["name"]] = (_find(docs, "ConfigMap", ref["name"])["data"][ref["key"]] if ref
                              else entry.get("value", ""))
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
            # liveness asks the process alone, and needs no token when tokens are required
            assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
            continue
        assert ports["grpc"] == int(env["SPECDEC_PORT"]), role
        assert ports["metrics"] == int(env["SPECDEC_METRICS_PORT"]), role
        assert env["SPECDEC_METRICS_HOST"] == "0.0.0.0", role  # scraped from outside the pod
        # grpc.health.v1: over TLS on the orchestrator's port, on the loopback health port of a
        # model service (test_probes_speak_tls checks the credentials)
        health = int(env.get("SPECDEC_HEALTH_PORT") or ports["grpc"])
        assert (role in ("target", "draft")) == (health != ports["grpc"]), role
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[:2] == ["specdec", "health"], (role, probe)
            assert command[-1] == f"127.0.0.1:{health}", (role, probe)
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
        if name in GPU_KUSTOMIZATIONS and role in ("target", "draft"):
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


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_setting_and_flag_exists_in_the_processes_help(name):
    docs = rendered(name)
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
        for init in _pod(docs, role).get("initContainers", []):  # components/model-hub's fetch-model
            text = _help(_module(init))
            for entry in init.get("env", []):
                if entry["name"].startswith("SPECDEC_"):
                    assert entry["name"] in text, f"{role}/{init['name']}: {entry['name']} not in --help"
            for arg in _command(init)[3:]:
                assert arg.startswith("--") and re.search(rf"\s{re.escape(arg)}\b", text), (role, arg)
    shared = dict(_find(docs, "ConfigMap", "specdec-config")["data"])
    # Read by the Redis client of every server (specdec/runtime/store.py), not flags.
    for name in ("SPECDEC_REDIS_PASSWORD", "SPECDEC_REDIS_USERNAME"):
        known_anywhere.add(name)
        assert f'"{name}"' in (ROOT / "specdec/runtime/store.py").read_text()
    for name in shared:
        assert name in known_anywhere, f"{name} is read by no process"
    for role in ROLES:  # each role's own Secret of settings: read by that role's process
        container = _container(docs, role)
        known = set(re.findall(r"\bSPECDEC_[A-Z_0-9]+\b", _help(_module(container))))
        known |= {"SPECDEC_REDIS_PASSWORD", "SPECDEC_REDIS_USERNAME"}
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                for name in _secret_data(_find(docs, "Secret", source["secretRef"]["name"])):
                    assert name in known, f"{role}: {name} is not read by {_module(container)}"


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
# The Secrets each pod may mount or read: its own role's, nothing else.
# specdec-hf-token: the Hugging Face token of components/model-hub's init containers (optional).
OWN_SECRETS = {"target": {"specdec-target-tls", "specdec-target-env", "specdec-hf-token"},
               "draft": {"specdec-draft-tls", "specdec-draft-env", "specdec-hf-token"},
               "orchestrator": {"specdec-orchestrator-tls", "specdec-orchestrator-env", "specdec-hf-token"},
               "gateway": {"specdec-ca"}, "redis": {"specdec-redis"}}


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


def _secrets_used(pod: dict) -> set[str]:
    """Every Secret a pod mounts or takes environment from."""
    names = set()
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    for container in _containers(pod):
        names |= {s["secretRef"]["name"] for s in container.get("envFrom", []) if "secretRef" in s}
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
    return names


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
        assert env["SPECDEC_REDIS_PASSWORD"] and env["SPECDEC_REDIS_USERNAME"], role


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_each_pod_holds_only_its_own_roles_secrets(name):
    docs = rendered(name)
    pods = {role: _pod(docs, role) for role in ROLES}
    pods["redis"] = _find(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]
    for role, pod in pods.items():
        assert _secrets_used(pod) <= OWN_SECRETS[role], (role, _secrets_used(pod))
        assert pod.get("automountServiceAccountToken") is False, role  # no API credentials either


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_model_services_require_the_orchestrators_certificate_and_hold_no_credential_of_theirs(name):
    from specdec.runtime.security import token_sha256

    docs = rendered(name)
    orchestrator_env = _env(_container(docs, "orchestrator"), docs)
    token = orchestrator_env["SPECDEC_SERVICE_TOKEN"]
    for role in ("target", "draft"):
        container = _container(docs, role)
        for setting, key in MODEL_TLS.items():
            _file_setting(docs, role, setting, key)
        files = {key for _, key in _mounted_files(docs, _pod(docs, role), container).values()}
        assert files == {"ca.crt", "server.crt", "server.key"}, (role, files)  # no client key
        env = _env(container, docs)
        assert "SPECDEC_SERVICE_TOKEN" not in env and token not in json.dumps(env), role
        assert env["SPECDEC_SERVICE_TOKEN_SHA256"].split(",")[0] == token_sha256(token), role
        assert "SPECDEC_SERVICE_TOKEN_SHA256" in _help(_module(container))
        assert env["SPECDEC_REDIS_USERNAME"] == role  # may write only its own role's registry keys
        assert env["SPECDEC_REDIS_PASSWORD"] != orchestrator_env["SPECDEC_REDIS_PASSWORD"]
        assert "SPECDEC_TLS_CLIENT_ID" not in env  # the default: spiffe://specdec/orchestrator
    # The orchestrator presents what the services require.
    for setting, key in ORCHESTRATOR_TLS.items():
        _file_setting(docs, "orchestrator", setting, key)
    assert orchestrator_env["SPECDEC_REDIS_USERNAME"] == "orchestrator"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_tenant_tokens_and_the_gateway(name):
    docs = rendered(name)
    files = _mounted_files(docs, _pod(docs, "orchestrator"), _container(docs, "orchestrator"))
    path = _env(_container(docs, "orchestrator"), docs)["SPECDEC_AUTH_TOKENS"]
    assert files[path] == ("specdec-orchestrator-tls", "tokens")
    from specdec.runtime.security import TokenTable

    # What specdec secrets writes.
    assert TokenTable.from_file(workdir() / "secrets" / "orchestrator" / "tokens").tenants
    # The gateway dials the orchestrator with TLS; it holds no token of its own (it has no
    # such setting): each caller's Authorization header is passed on.
    gateway = _container(docs, "gateway")
    assert not re.search(r"--([a-z]+-)*token\b|SPECDEC_([A-Z]+_)*TOKEN\b", _help("gateway"))
    _file_setting(docs, "gateway", "SPECDEC_TLS_CA", "ca.crt")
    assert set(_mounted_files(docs, _pod(docs, "gateway"), gateway).values()) == {("specdec-ca", "ca.crt")}
    assert "/secrets/ca.crt" in _env(gateway, docs)["SPECDEC_REDIS_URL"]  # the same CA everywhere
    # /metrics on its own port, where Prometheus is told to look.
    env = _env(gateway, docs)
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    annotations = _find(docs, "Deployment", "specdec-gateway")["spec"]["template"]["metadata"]["annotations"]
    assert int(env["SPECDEC_METRICS_PORT"]) == ports["metrics"] == int(annotations["prometheus.io/port"])
    assert ports["metrics"] != ports["http"]


@functools.cache
def _health_help() -> str:
    # `specdec` is the console script of launcher.cli:main (pyproject.toml).
    out = subprocess.run([sys.executable, "-c", "import sys; from launcher.cli import main; "
                          "sys.exit(main(['health', '--help']))"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_probes_speak_tls_or_stay_on_loopback(name):
    """Native grpc: probes have no TLS: the orchestrator's exec `specdec health` with the CA over
    TLS; a model service's TLS port wants the orchestrators' client certificate, which its pod
    does not hold, so its probes dial its plaintext health port on the pod's loopback."""
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
            if role == "orchestrator":
                assert files[options["--tls-ca"]][1] == "ca.crt"
            else:
                assert options == {} and args[-1] == f"127.0.0.1:{env['SPECDEC_HEALTH_PORT']}"


def test_secrets_come_from_git_ignored_files():
    spec = yaml.safe_load((SECRETS / "kustomization.yaml").read_text())
    folder = workdir() / "secrets"
    written = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"kustomization.yaml"}
    used = set()
    for gen in spec["secretGenerator"]:
        used |= {f.rpartition("=")[2] for f in [*gen.get("files", []), *gen.get("envs", [])]}
    assert used <= written, used - written  # every file is one `specdec secrets` writes
    assert not {"ca.key", "state.json"} & used  # the CA's key never enters the cluster
    # One Secret per role, each from that role's folder only.
    for gen in spec["secretGenerator"]:
        folders = {Path(f.rpartition("=")[2]).parent.name for f in [*gen.get("files", []), *gen.get("envs", [])]}
        assert len(folders) == 1, (gen["name"], folders)
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    assert all(f"--host {h}" in docs or f"--host '{h}'" in docs for h in recipe_hosts())
    if shutil.which("git") and (ROOT / ".git").exists():
        for name in written:
            path = f"deploy/k8s/secrets/{name}"
            assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
        assert subprocess.run(["git", "check-ignore", "-q", "deploy/k8s/secrets/kustomization.yaml"],
                              cwd=ROOT).returncode == 1


def _names_dialed(docs) -> dict[str, set[str]]:
    """{server role: the names its clients dial it by}."""
    gateway_env = _env(_container(docs, "gateway"), docs)
    redis_url = _env(_container(docs, "target"), docs)["SPECDEC_REDIS_URL"]
    names = {"orchestrator": {gateway_env["SPECDEC_ORCHESTRATOR"].rsplit(":", 1)[0], "127.0.0.1"},
             "redis": {re.match(r"rediss://([^:/]+)", redis_url)[1]}}
    for role in ("target", "draft"):
        names[role] = {_advertise_address(_container(docs, role), pod_ip=ip).rsplit(":", 1)[0]
                       for ip in ("10.244.1.7", "10.0.255.3")}
    return names


def test_each_certificate_covers_the_names_its_role_is_dialed_by_and_no_other():
    """A real TLS handshake per name the processes dial, checked as grpc checks it, against the
    server certificate of that role from the recipe's --host names (and not another role's)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    names = _names_dialed(rendered("base"))
    secrets = workdir() / "secrets"
    client = secrets / "orchestrator"

    def handshake(port: int, name: str) -> bool:
        credentials = grpc.ssl_channel_credentials((client / "ca.crt").read_bytes(),
                                                   (client / "client.key").read_bytes(),
                                                   (client / "client.crt").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                                 options=[("grpc.ssl_target_name_override", name)]) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return True
            except grpc.RpcError:
                return False

    for role, dialed in names.items():
        own = secrets / role
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [((own / "server.key").read_bytes(), (own / "server.crt").read_bytes())],
            root_certificates=(own / "ca.crt").read_bytes(), require_client_auth=True))
        server.start()
        try:
            for name in sorted(dialed):
                assert handshake(port, name), f"the {role} certificate does not cover {name}"
            others = set().union(*(n for r, n in names.items() if r != role)) - {"127.0.0.1"}
            for name in sorted(others):
                assert not handshake(port, name), f"the {role} certificate also covers {name}"
            assert not handshake(port, "10.244.1.7")  # why replicas advertise a DNS name, not their IP
        finally:
            server.stop(None)


# ------------------------------------------------------------------- pod security

# The restricted Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards),
# baseline rules included, as the admission controller applies them to a pod spec.
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_GOOD_PROFILES = {"RuntimeDefault", "Localhost"}


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]


def _context_violations(where: str, ctx: dict) -> list[str]:
    """Rules that hold for the pod's and for each container's securityContext alike."""
    out = []
    if ctx.get("windowsOptions", {}).get("hostProcess"):
        out.append(f"{where}: hostProcess")
    if ctx.get("runAsUser") == 0:
        out.append(f"{where}: runAsUser 0")
    if ctx.get("runAsNonRoot") is False:
        out.append(f"{where}: runAsNonRoot false")
    selinux = ctx.get("seLinuxOptions", {})
    if selinux.get("type", "") not in _SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        out.append(f"{where}: seLinuxOptions {selinux}")
    for key in ("seccompProfile", "appArmorProfile"):
        if ctx.get(key, {}).get("type") == "Unconfined":
            out.append(f"{where}: {key} Unconfined")
    return out


def restricted_violations(pod: dict, annotations: dict | None = None) -> list[str]:
    """What in this pod spec the restricted profile refuses (empty: admitted)."""
    out: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"pod: {key}")
    pod_ctx = pod.get("securityContext", {})
    out += _context_violations("pod", pod_ctx)
    unsafe = [s["name"] for s in pod_ctx.get("sysctls", []) if s["name"] not in _SAFE_SYSCTLS]
    if unsafe:
        out.append(f"pod: sysctls {unsafe}")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds - _RESTRICTED_VOLUMES)}")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value in ("runtime/default", "") or value.startswith("localhost/")):
            out.append(f"annotation {key}: {value}")
    pod_non_root = pod_ctx.get("runAsNonRoot") is True
    pod_seccomp = pod_ctx.get("seccompProfile", {}).get("type") in _GOOD_PROFILES
    for c in _containers(pod):
        where = f"container {c['name']}"
        ctx = c.get("securityContext", {})
        out += _context_violations(where, ctx)
        if ctx.get("privileged"):
            out.append(f"{where}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if not (pod_non_root or ctx.get("runAsNonRoot") is True):
            out.append(f"{where}: runAsNonRoot is not true (nor the pod's)")
        if not (pod_seccomp or ctx.get("seccompProfile", {}).get("type") in _GOOD_PROFILES):
            out.append(f"{where}: no RuntimeDefault/Localhost seccompProfile (nor the pod's)")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities add {caps['add']}")
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {ctx['procMount']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
    return out


def _pod_templates(docs):
    """(kind/name, pod template) of every workload in `docs`."""
    for doc in docs:
        template = doc.get("spec", {}).get("template") or doc.get("spec", {}).get("jobTemplate", {}).get(
            "spec", {}).get("template")
        if doc["kind"] == "Pod":
            template = doc
        if template:
            yield f"{doc['kind']}/{doc['metadata']['name']}", template


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_pod_meets_the_restricted_pod_security_standard(name):
    # The namespace enforces it too: the API server refuses a pod spec that breaks it.
    namespace = _find(rendered(name), "Namespace", "specdec")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted", namespace
    templates = list(_pod_templates(rendered(name)))
    assert len(templates) == 5  # the four roles and Redis
    for where, template in templates:
        pod = template["spec"]
        assert not restricted_violations(pod, template.get("metadata", {}).get("annotations")), where
        for c in _containers(pod):  # beyond the standard: nothing writes the image
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (where, c["name"])
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            assert writable, (where, "a read-only root needs somewhere to write")


@pytest.mark.parametrize("break_it", [
    lambda pod, c: pod["securityContext"].pop("runAsNonRoot"),
    lambda pod, c: pod["securityContext"].update(runAsUser=0),
    lambda pod, c: pod["securityContext"].pop("seccompProfile"),
    lambda pod, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    lambda pod, c: c["securityContext"].update(allowPrivilegeEscalation=True),
    lambda pod, c: c["securityContext"].update(privileged=True),
    lambda pod, c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
    lambda pod, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    lambda pod, c: pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
    lambda pod, c: pod.update(hostNetwork=True),
    lambda pod, c: c["ports"].append({"containerPort": 80, "hostPort": 80}),
    lambda pod, c: pod["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
], ids=["runAsNonRoot", "root", "seccomp", "unconfined", "escalation", "privileged", "drop", "add",
        "hostPath", "hostNetwork", "hostPort", "sysctl"])
def test_the_pod_security_check_finds_each_broken_rule(break_it):
    template = copy.deepcopy(_find(rendered("base"), "Deployment", "specdec-target")["spec"]["template"])
    pod = template["spec"]
    assert restricted_violations(pod) == []
    break_it(pod, pod["containers"][0])
    assert restricted_violations(pod)


# ------------------------------------------------------------------- network policies


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, present = labels.get(expr["key"]), expr["key"] in labels
        ok = {"In": present and value in expr.get("values", []),
              "NotIn": not present or value not in expr.get("values", []),
              "Exists": present, "DoesNotExist": not present}[expr["operator"]]
        if not ok:
            return False
    return True


def reachable(policies: list[dict], source: dict | None, target: dict, port: str,
              namespace: dict | None = None) -> bool:
    """Whether a pod labelled `source` (None: a pod in another namespace, labelled `namespace`)
    may open `port` (a container port name) on a pod labelled `target`, under these ingress
    NetworkPolicies."""
    namespace = {"kubernetes.io/metadata.name": "specdec"} if source is not None else (namespace or {})
    selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            if rule.get("ports") and port not in [p.get("port") for p in rule["ports"]]:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                if "namespaceSelector" in peer:
                    if _selects(peer["namespaceSelector"], namespace) and (
                            "podSelector" not in peer or _selects(peer["podSelector"], source or {})):
                        return True
                elif "podSelector" in peer and source is not None and _selects(peer["podSelector"], source):
                    return True
    return False


def test_network_policies_let_only_orchestrators_reach_the_model_services():
    docs = rendered("base")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {role: _find(docs, kind, name)["spec"]["template"]["metadata"]["labels"] for role, kind, name in (
        ("target", "Deployment", "specdec-target"), ("draft", "Deployment", "specdec-draft"),
        ("orch", "Deployment", "specdec-orchestrator"), ("gateway", "Deployment", "specdec-gateway"),
        ("redis", "StatefulSet", "redis"))}
    labels["elsewhere"] = None  # a pod of another namespace
    expected = {  # (source, destination, port): reachable
        ("orch", "target", "grpc"): True, ("orch", "draft", "grpc"): True,
        ("draft", "target", "grpc"): False, ("target", "draft", "grpc"): False,
        ("target", "target", "grpc"): False, ("gateway", "target", "grpc"): False,
        ("redis", "draft", "grpc"): False, ("elsewhere", "target", "grpc"): False,
        ("orch", "redis", "redis"): True, ("target", "redis", "redis"): True,
        ("draft", "redis", "redis"): True, ("gateway", "redis", "redis"): False,
        ("elsewhere", "redis", "redis"): False,
        ("gateway", "orch", "grpc"): True, ("target", "orch", "grpc"): False,
        ("elsewhere", "orch", "grpc"): False, ("elsewhere", "gateway", "http"): True,
        # metrics: the monitoring namespace only
        ("elsewhere", "target", "metrics"): False, ("elsewhere", "orch", "metrics"): False,
        ("elsewhere", "gateway", "metrics"): False, ("gateway", "target", "metrics"): False,
        ("monitoring", "target", "metrics"): True, ("monitoring", "orch", "metrics"): True,
        ("monitoring", "gateway", "metrics"): True, ("monitoring", "target", "grpc"): False,
    }
    labels["monitoring"] = None
    for (source, dest, port), allowed in expected.items():
        namespace = {"kubernetes.io/metadata.name": source} if labels[source] is None else None
        assert reachable(policies, labels[source], labels[dest], port, namespace) == allowed, (source, dest, port)
    # Egress is denied by default too: each pod reaches DNS and what it calls, nothing else.
    out = None  # an address outside the cluster
    egress = {
        ("gateway", "orch", 50050): True, ("gateway", "target", 50061): False, ("gateway", out, 443): False,
        ("gateway", "redis", 6379): False, ("orch", "target", 50061): True, ("orch", "draft", 50062): True,
        ("orch", "redis", 6379): True, ("orch", out, 443): False, ("orch", out, 6379): False,
        ("target", "redis", 6379): True, ("draft", "redis", 6379): True, ("target", "draft", 50062): False,
        ("target", out, 443): False, ("redis", out, 443): False, ("redis", "target", 50061): False,
    }
    for (source, dest, port), allowed in egress.items():
        assert _egress_allowed(policies, labels[source], labels[dest] if dest else None, port) == allowed, \
            (source, dest, port)
    for role in ("gateway", "orch", "target", "draft", "redis"):
        assert _egress_allowed(policies, labels[role], None, 53, "UDP"), role  # cluster DNS
    # Each port a policy names is a port of the pods it selects.
    for policy in policies:
        pods = [t for _, t in _pod_templates(docs) if _selects(policy["spec"]["podSelector"], t["metadata"]["labels"])]
        assert pods, policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                for template in pods:
                    names = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
                    assert port["port"] in names, (policy["metadata"]["name"], port)


# ------------------------------------------------------------------- models


# What each rendering serves: specdec-models' keys (base/models.yaml and the overlays' patches).
EXPECTED_MODELS = {"base": {"target": "", "draft": ""}, "cpu": {"target": "", "draft": ""},
                   "gpu": {"target": "", "draft": ""},
                   "user-model": {"target": "HuggingFaceTB/SmolLM2-360M-Instruct",
                                  "draft": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                   "mixed": {"target": MIXED_MODELS["target"], "draft": MIXED_MODELS["draft"]}}
MODEL_SETTINGS = {"target": ("SPECDEC_MODEL", "SPECDEC_REVISION"), "draft": ("SPECDEC_MODEL", "SPECDEC_REVISION"),
                  "orchestrator": ("SPECDEC_TOKENIZER", "SPECDEC_TOKENIZER_REVISION")}


def _mount_of(container: dict, path: str) -> dict | None:
    """The volumeMount whose mountPath holds `path` (the longest such)."""
    hits = [m for m in container.get("volumeMounts", [])
            if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(hits, key=lambda m: len(m["mountPath"]), default=None)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_each_role_serves_the_model_its_key_names_from_where_it_is(name):
    """A role's model and revision come from its specdec-models keys (the orchestrator's tokenizer
    from the target's); a /models folder is on the read-only PVC mounted there, an id is fetched
    into the volume where the process reads HF_HOME offline, by an init container with the same
    model, revision and HF_HOME, and the Hub reachable."""
    from launcher.fetch import is_hub_id

    docs = rendered(name)
    models = _find(docs, "ConfigMap", "specdec-models")["data"]
    assert {role: models[role] for role in ("target", "draft")} == EXPECTED_MODELS[name]
    for role, (model_var, revision_var) in MODEL_SETTINGS.items():
        key = "target" if role == "orchestrator" else role
        pod, container = _pod(docs, role), _container(docs, role)
        env = _env(container, docs)
        spec = env[model_var]
        assert (spec, env[revision_var]) == (models[key], models[f"{key}-revision"]), role
        inits = {c["name"]: c for c in pod.get("initContainers", [])}
        if spec.startswith("/models/"):
            mount = _mount_of(container, spec)
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert mount["readOnly"] and volume["persistentVolumeClaim"]["readOnly"], role
            claim = _find(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            assert "ReadOnlyMany" in claim["spec"]["accessModes"]  # every replica, on any node
        elif spec:
            assert is_hub_id(spec), (role, spec)
            fetch = inits["fetch-model"]
            fetch_env = _env(fetch, docs)
            assert (fetch_env[model_var], fetch_env[revision_var]) == (spec, env[revision_var]), role
            assert _command(fetch)[:3] == ["python", "-m", "launcher.fetch"]
            assert ("--tokenizer-only" in _command(fetch)) == (role == "orchestrator")  # no weights there
            assert fetch_env["HF_HUB_OFFLINE"] == "0" and env["HF_HUB_OFFLINE"] == "1", role
            assert fetch_env["HF_HOME"] == env["HF_HOME"], role
            # The same pod volume, writable by the init container, under HF_HOME in both.
            theirs, ours = _mount_of(fetch, fetch_env["HF_HOME"]), _mount_of(container, env["HF_HOME"])
            assert theirs and ours and theirs["name"] == ours["name"] and not theirs.get("readOnly"), role
            assert theirs["mountPath"] == ours["mountPath"]
            token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
            assert token["optional"] is True  # public models need none
            assert "HF_TOKEN" not in env, role  # the serving process never holds it
        else:
            assert "fetch-model" not in inits and _mount_of(container, "/models/x") is None, role


def test_launcher_fetch_runs_in_every_pod_that_fetches_and_matches_the_hub_loader():
    """The init containers' module exists in the image's packages, and it fetches what the
    services read (engine.model.hub's patterns, where that module is)."""
    import launcher.fetch as fetch

    assert (ROOT / "launcher" / "fetch.py").is_file()
    hub = pytest.importorskip("engine.model.hub")
    assert (fetch.FILES, fetch.WEIGHTS, fetch.LEGACY_WEIGHTS, fetch.DEFAULT_REVISION) == (
        hub.FILES, hub.WEIGHTS, hub.LEGACY_WEIGHTS, hub.DEFAULT_REVISION)
    for spec in ("Qwen/Qwen2.5-0.5B-Instruct", "a/b", "/models/x", "./x/y", "~/x", "a/b/c", "a/../b", "", "x"):
        assert fetch.is_hub_id(spec) == hub.is_hub_id(spec), spec


def _egress_allowed(policies: list[dict], source: dict, dest: dict | None, port: int, protocol: str = "TCP") -> bool:
    """Whether a pod labelled `source` may open `port` on `dest` (pod labels in this namespace;
    None: an address outside the cluster) under these NetworkPolicies' egress rules."""
    selecting = [p["spec"] for p in policies if "Egress" in p["spec"].get("policyTypes", [])
                 and _selects(p["spec"]["podSelector"], source)]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("egress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports):
                continue
            peers = rule.get("to")
            if not peers:
                return True
            if dest is not None and any(set(peer) == {"podSelector"} and _selects(peer["podSelector"], dest)
                                        for peer in peers):
                return True
    return False


@pytest.mark.parametrize("name", ["user-model", "mixed"])
def test_pods_that_fetch_reach_the_hub_dns_and_their_namespace_only(name):
    docs = rendered(name)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {role: _find(docs, "Deployment", f"specdec-{role}")["spec"]["template"]["metadata"]["labels"]
              for role in ROLES}
    labels["redis"] = _find(docs, "StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"]
    for role in ("target", "draft", "orchestrator"):
        assert "fetch-model" in {c["name"] for c in _pod(docs, role)["initContainers"]}
        source = labels[role]
        assert _egress_allowed(policies, source, None, 443), role                  # the Hub
        assert _egress_allowed(policies, source, None, 53, "UDP"), role            # DNS
        assert _egress_allowed(policies, source, labels["redis"], 6379), role      # Redis
        assert not _egress_allowed(policies, source, None, 6379), role             # nothing else out
        assert not _egress_allowed(policies, source, None, 80), role
    assert _egress_allowed(policies, labels["orchestrator"], labels["target"], 50061)
    assert _egress_allowed(policies, labels["orchestrator"], labels["draft"], 50062)
    # Pods that fetch nothing keep the base's egress: what they call, nothing out.
    assert not _egress_allowed(policies, labels["gateway"], None, 80)
    assert not _egress_allowed(policies, labels["gateway"], None, 443)


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
            assert re.search(r"\b(specdec_|vllm:)[a-z_]+", target["expr"]), target["expr"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        assert panel["datasource"]["uid"] == "${datasource}"
    titles = " ".join(p["title"].lower() for p in graphs)
    for topic in ("tokens / s", "acceptance", "passes per token", "cache", "errors", "round"):
        assert topic in titles or topic in json.dumps(dashboard).lower(), topic

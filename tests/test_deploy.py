"""deploy/: the Kubernetes manifests (base + overlays, rendered here) and the Grafana dashboard.

Offline: every rendered manifest validates strictly against the Kubernetes schemas that
`kubernetes-validate` ships; probes target the ports the processes listen on; every
SPECDEC_* name and flag used exists in the processes' own --help; grace periods cover
the drain. The live check of the dashboard's metric names is in
tests/integration/test_gateway.py.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu": K8S / "overlays/cpu", "gpu": K8S / "overlays/gpu"}
ROLES = ("target", "draft", "orchestrator", "gateway")

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


def render(folder: Path) -> list[dict]:
    """The subset of kustomize these files use: resources, namespace, patches (by kind + name)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        docs += render(path) if path.is_dir() else _load(path)
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
    return tuple(render(KUSTOMIZATIONS[name]))


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
            env.update(_find(docs, "Secret", source["secretRef"]["name"]).get("stringData", {}))
    env.update({e["name"]: e.get("value", "") for e in container.get("env", [])})
    return env


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_python_rendering_matches_kubectl_kustomize(name):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the Python rendering is what the other tests check)")
    out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZATIONS[name])], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"kubectl kustomize unavailable: {out.stderr.strip()[:200]}")
    theirs = {(d["kind"], d["metadata"]["name"]): _sorted(d) for d in yaml.safe_load_all(out.stdout) if d}
    ours = {(d["kind"], d["metadata"]["name"]): _sorted(d) for d in rendered(name)}
    assert ours == theirs


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
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "x"
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
            assert ports["http"] == int(env["SPECDEC_GATEWAY_PORT"])
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["port"] in ("http", ports["http"])
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            continue
        assert ports["grpc"] == int(env["SPECDEC_PORT"]), role
        assert ports["metrics"] == int(env["SPECDEC_METRICS_PORT"]), role
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == ports["grpc"], (role, probe)  # grpc.health.v1
        if role in ("target", "draft"):
            assert env["SPECDEC_ADVERTISE_ADDRESS"].endswith(f":{ports['grpc']}")
            assert env["SPECDEC_REDIS_URL"]  # replicas register for discovery


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
    source = (ROOT / "specdec/hosting/metrics.py").read_text()
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
    command = container["command"]
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
        for arg in container.get("args", []):
            if arg.startswith("--"):
                assert re.search(rf"\s{re.escape(arg)}\b", text), f"{role}: {arg} not in --help"
    shared = dict(_find(docs, "ConfigMap", "specdec-config")["data"])
    shared.update(_find(docs, "Secret", "specdec-secrets")["stringData"])
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

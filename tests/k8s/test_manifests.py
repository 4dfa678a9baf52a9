"""deploy/k8s: rendered offline with kustomize and checked against the Kubernetes API schemas
(strict: an unknown or misspelled field fails), then against pdproxy's own settings classes
and against each other (probes on the real health routes, selectors, the static backend list
versus the StatefulSets' replicas, Secret references, who may reach which port).

Rendering needs ``kubectl`` (its built-in kustomize) or ``kustomize`` on PATH; without either
the tests say so and skip.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError as SchemaError
from pydantic_settings import BaseSettings

from kvtier.worker.settings import WorkerSettings
from pdproxy.routing.kv.build import parse_settings
from pdproxy.settings import ProxySettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBE_VERSION = "1.34"
"""The API version the manifests are checked against (schemas ship with kubernetes-validate)."""
OVERLAYS = ["base", "overlays/example"]

Doc = dict[str, Any]
S = TypeVar("S", bound=BaseSettings)


def _kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(tree: Path, target: str) -> list[Doc]:
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is on PATH: cannot render deploy/k8s")
    out = subprocess.run(
        [*command, str(tree / target)], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def copy_tree(folder: Path) -> Path:
    """A copy of deploy/k8s with freshly generated keys (as a user's make-secrets run)."""
    copy_of = folder / "k8s"
    shutil.copytree(K8S, copy_of, ignore=shutil.ignore_patterns("secrets"))
    subprocess.run(
        [str(copy_of / "make-secrets"), str(copy_of / "overlays" / "example")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return copy_of


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy for the tests that only read it."""
    return copy_tree(tmp_path_factory.mktemp("k8s"))


@pytest.fixture
def own_tree(tmp_path: Path) -> Path:
    """A copy for a test that changes it."""
    return copy_tree(tmp_path)


@pytest.fixture(scope="module")
def example(tree: Path) -> list[Doc]:
    """The example overlay, rendered once (tests deep-copy before changing a document)."""
    return render(tree, "overlays/example")


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    yield from (d for d in docs if d["kind"] in ("Deployment", "StatefulSet"))


def container_env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def expand(value: str, variables: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables[m.group(1)], value)


def plain_env(container: Doc, secrets: dict[str, dict[str, str]], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it: ``envFrom`` first, then ``env`` in
    order, each ``$(VAR)`` expanded from what is defined before it."""
    out: dict[str, str] = {}
    for source in container.get("envFrom", []):
        out.update(secrets[source["secretRef"]["name"]])
    for entry in container.get("env", []):
        source = entry.get("valueFrom")
        if source is None:
            out[entry["name"]] = expand(entry["value"], out)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            out[entry["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            out[entry["name"]] = pod_name
    return out


def from_env(cls: type[S], env: dict[str, str], prefix: str) -> S:
    """``cls()`` reading exactly the container's ``prefix`` variables, as the process would."""
    with pytest.MonkeyPatch.context() as patch:
        for name in os.environ:
            if name.startswith(prefix):
                patch.delenv(name)
        for name, value in env.items():
            if name.startswith(prefix):
                patch.setenv(name, value)
        return cls()


def secret_values(docs: list[Doc]) -> dict[str, dict[str, str]]:
    """Secret name → key → value."""
    return {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d["data"].items()}
        for d in docs
        if d["kind"] == "Secret"
    }


def generated(tree: Path) -> dict[str, str]:
    """The key files make-secrets wrote."""
    folder = tree / "overlays" / "example" / "secrets"
    return {path.name: path.read_text() for path in folder.iterdir()}


# ----------------------------------------------------------------------------- the API types


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_object_is_valid_for_the_kubernetes_api(tree: Path, target: str) -> None:
    docs = render(tree, target)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _misspell(doc: Doc, path: list[str | int], wrong: str) -> None:
    node: Any = doc
    for step in path[:-1]:
        node = node[step]
    node[wrong] = node.pop(path[-1])


@pytest.mark.parametrize(
    ("kind", "name", "path", "wrong"),
    [
        ("Deployment", "pdproxy",
         ["spec", "template", "spec", "containers", 0, "readinessProbe"], "readinesProbe"),
        ("Deployment", "pdproxy",
         ["spec", "template", "spec", "containers", 0, "resources", "requests"], "request"),
        ("Service", "producer", ["spec", "clusterIP"], "clusterIp"),
        ("StatefulSet", "consumer", ["spec", "serviceName"], "servicename"),
        ("PodDisruptionBudget", "pdproxy", ["spec", "minAvailable"], "minavailable"),
    ],
)  # fmt: skip
def test_a_misspelled_field_fails_validation(
    example: list[Doc], kind: str, name: str, path: list[str | int], wrong: str
) -> None:
    doc = copy.deepcopy(find(example, kind, name))
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    _misspell(doc, path, wrong)
    with pytest.raises(SchemaError, match=wrong):
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_a_misspelled_field_in_a_patch_file_fails_after_rendering(own_tree: Path) -> None:
    patch = own_tree / "overlays" / "example" / "backends.yaml"
    patch.write_text(patch.read_text().replace("containers:", "containerz:", 1))
    docs = render(own_tree, "overlays/example")
    with pytest.raises(SchemaError, match="containerz"):
        kubernetes_validate.validate(find(docs, "Deployment", "pdproxy"), KUBE_VERSION, True)


# ----------------------------------------------------------------------------- the proxy


def test_proxy_probes_hit_the_real_health_routes(example: list[Doc]) -> None:
    deployment = find(example, "Deployment", "pdproxy")
    [proxy] = pod_spec(deployment)["containers"]
    env = container_env(proxy)
    port = int(env["PDPROXY_PORT"]["value"])
    assert env["PDPROXY_HOST"]["value"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert ports["http"] == port
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # /ready and /health are the app's own routes (not a guess at a path).
    from pdproxy.app import create_app

    routes = {getattr(r, "path", None) for r in create_app(ProxySettings()).routes}
    assert {"/ready", "/health", "/metrics"} <= routes

    service = find(example, "Service", "pdproxy")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = find(example, "PodDisruptionBudget", "pdproxy")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    # The drain (readiness false, then in-flight requests finish) fits the grace period.
    drain = float(env["PDPROXY_DRAIN_DELAY_S"]["value"]) + float(
        env["PDPROXY_DRAIN_TIMEOUT_S"]["value"]
    )
    assert drain < pod_spec(deployment)["terminationGracePeriodSeconds"]


def test_proxy_settings_parse_and_name_every_worker_pod(example: list[Doc], tree: Path) -> None:
    keys = generated(tree)
    secrets = secret_values(example)
    deployment = find(example, "Deployment", "pdproxy")
    [proxy] = pod_spec(deployment)["containers"]
    env = plain_env(proxy, secrets, "pdproxy-abc")
    settings = from_env(ProxySettings, env, "PDPROXY_")
    assert [k.key.get_secret_value() for k in settings.api_keys] == [keys["client-api-key"]]
    router = parse_settings(settings.router_options)
    assert router.index_url == "redis://redis:6379/0"

    # One backend per StatefulSet pod, at its stable DNS name, with the workers' key.
    for role in ("producer", "consumer"):
        replicas = find(example, "StatefulSet", role)["spec"]["replicas"]
        named = sorted(b.name for b in settings.backends if b.role == role)
        assert named == [f"{role}-{i}" for i in range(replicas)]
    for backend in settings.backends:
        assert backend.url == f"http://{backend.name}.{backend.role}:8100"
        assert backend.api_key is not None
        assert backend.api_key.get_secret_value() == keys["worker-api-key"]
        if backend.role == "producer":
            assert backend.kv_address == f"{backend.name}.producer:5600"


def test_worker_settings_parse_and_consumers_allow_every_producer(
    example: list[Doc], tree: Path
) -> None:
    keys = generated(tree)
    secrets = secret_values(example)
    producers = find(example, "StatefulSet", "producer")
    allowed: list[str] = []
    for role in ("producer", "consumer"):
        statefulset = find(example, "StatefulSet", role)
        [worker] = pod_spec(statefulset)["containers"]
        env = plain_env(worker, secrets, f"{role}-1")
        settings = from_env(WorkerSettings, env, "KVTIER_WORKER_")
        assert settings.api_key is not None
        assert settings.api_key.get_secret_value() == keys["worker-api-key"]
        assert settings.p2p_secret.get_secret_value() == keys["p2p-secret"]
        assert settings.advertise_host == f"{role}-1.{role}"
        assert settings.engine_id == f"{role}-1"
        if role == "consumer":
            allowed = settings.p2p_allowed_peers
        ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
        command = worker["command"]
        assert command[command.index("--port") + 1] == str(ports["http"])
        assert command[command.index("--role") + 1] == role
        assert worker["readinessProbe"]["httpGet"]["path"] == "/health"
    expected = [f"producer-{i}.producer:5600" for i in range(producers["spec"]["replicas"])]
    assert allowed == expected


# ----------------------------------------------------------------------------- everything


def test_every_container_requests_resources(example: list[Doc]) -> None:
    for workload in workloads(example):
        for container in pod_spec(workload)["containers"]:
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= requests.keys(), workload["metadata"]["name"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_prometheus_scrapes_a_declared_metrics_port(example: list[Doc]) -> None:
    scraped = set()
    for workload in workloads(example):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        scraped.add(workload["metadata"]["name"])
        ports = {p["containerPort"] for c in pod_spec(workload)["containers"] for p in c["ports"]}
        assert int(annotations["prometheus.io/port"]) in ports
        assert annotations["prometheus.io/path"] == "/metrics"
    assert scraped == {"pdproxy", "producer", "consumer"}


def test_headless_services_select_their_statefulsets(example: list[Doc]) -> None:
    for role in ("producer", "consumer"):
        service = find(example, "Service", role)
        statefulset = find(example, "StatefulSet", role)
        assert service["spec"]["clusterIP"] == "None"
        assert statefulset["spec"]["serviceName"] == role
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        container_ports = {p["name"] for p in pod_spec(statefulset)["containers"][0]["ports"]}
        # Named ports: SRV records (_http._tcp.<service>) for DNS discovery.
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports


def test_keys_come_from_the_generated_secrets_only(example: list[Doc], tree: Path) -> None:
    keys = generated(tree)
    assert set(keys) == {"client-api-key", "worker-api-key", "p2p-secret"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in keys.values())
    secrets = secret_values(example)
    # Every value in a rendered Secret is one of the generated keys, and every reference
    # resolves to a rendered Secret's key.
    assert {v for data in secrets.values() for v in data.values()} == set(keys.values())
    refs: list[tuple[str, str | None]] = []
    for workload in workloads(example):
        for container in pod_spec(workload)["containers"]:
            refs += [(e["secretRef"]["name"], None) for e in container.get("envFrom", [])]
            refs += [
                (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            ]
    assert {name for name, _ in refs} == set(secrets)
    for name, key in refs:
        assert key is None or key in secrets[name]
    # No key value is written anywhere else in the rendered objects.
    others = json.dumps([d for d in example if d["kind"] != "Secret"])
    assert not any(v in others for v in keys.values())


def test_no_secret_is_committed(own_tree: Path) -> None:
    """The base refers to a Secret it does not create; the repository holds no key files and
    no Secret object (a user generates them, or the render fails for want of the files)."""
    base = render(own_tree, "base")
    assert not [d for d in base if d["kind"] == "Secret"]
    for path in K8S.rglob("*"):
        assert "secrets" not in path.relative_to(K8S).parts, path
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(path.read_text()):
                assert not (doc and doc.get("kind") == "Secret"), path
    shutil.rmtree(own_tree / "overlays" / "example" / "secrets")
    command = _kustomize_command()
    assert command is not None
    out = subprocess.run(
        [*command, str(own_tree / "overlays" / "example")],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "secrets" in out.stderr


def test_network_policies_keep_event_sockets_and_redis_to_the_proxy(example: list[Doc]) -> None:
    """The attacker is any other pod in the cluster: it must not read KV events (prompt token
    ids), reach Redis, or open P2P to a producer."""
    proxy_labels = pod_spec_labels(find(example, "Deployment", "pdproxy"))
    consumer_labels = pod_spec_labels(find(example, "StatefulSet", "consumer"))

    def who_may_reach(policy: Doc, port: str) -> list[dict[str, str] | None]:
        out: list[dict[str, str] | None] = []
        for rule in policy["spec"]["ingress"]:
            if port in {p["port"] for p in rule.get("ports", [])}:
                peers = rule.get("from")
                out.extend([p["podSelector"]["matchLabels"] for p in peers] if peers else [None])
        return out

    for role in ("producer", "consumer"):
        policy = find(example, "NetworkPolicy", role)
        target = pod_spec_labels(find(example, "StatefulSet", role))
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= target.items()
        events = who_may_reach(policy, "events")
        assert len(events) == 1 and events[0] is not None
        assert events[0].items() <= proxy_labels.items()
    producer_p2p = who_may_reach(find(example, "NetworkPolicy", "producer"), "p2p")
    assert len(producer_p2p) == 1 and producer_p2p[0] is not None
    assert producer_p2p[0].items() <= consumer_labels.items()
    redis = who_may_reach(find(example, "NetworkPolicy", "redis"), "redis")
    assert len(redis) == 1 and redis[0] is not None
    assert redis[0].items() <= proxy_labels.items()


def pod_spec_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels

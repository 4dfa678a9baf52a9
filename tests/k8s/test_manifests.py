"""deploy/k8s's objects against each other: resources and privileges of every container,
scrape ports, Services and their StatefulSets, Secret references and where keys may appear,
and who may reach which port (the network policies).

The API schemas: :mod:`tests.k8s.test_manifest_schemas`; the proxy's and workers' settings:
:mod:`tests.k8s.test_manifest_settings`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.k8s.manifests import (
    K8S,
    Doc,
    find,
    generated,
    kustomize_command,
    pod_spec,
    pod_spec_labels,
    render,
    secret_values,
    workloads,
)


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
    command = kustomize_command()
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

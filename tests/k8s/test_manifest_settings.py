"""deploy/k8s's proxy and workers as the processes would start: their environment parsed by
pdproxy's and kvtier's own settings classes, probes on the real health routes, the static
backend list versus the StatefulSets' replicas, the consumers' allowed producers."""

from __future__ import annotations

from pathlib import Path

from kvtier.worker.settings import WorkerSettings
from pdproxy.routing.kv.build import parse_settings
from pdproxy.settings import ProxySettings
from tests.k8s.manifests import (
    Doc,
    container_env,
    find,
    from_env,
    generated,
    plain_env,
    pod_spec,
    secret_values,
)


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

"""docker/compose.yaml: services, ports, env, health checks and commands against the real CLIs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from kvtier.worker.__main__ import parse_settings
from kvtier.worker.settings import WorkerSettings
from pdproxy.cli import build_parser, settings_from_args
from pdproxy.settings import ProxySettings
from tests.docker.conftest import ROOT, environment, load_compose

WORKERS = ["producer-0", "producer-1", "consumer-0", "consumer-1"]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose("compose.yaml")


def _worker_settings(service: dict[str, Any], env: pytest.MonkeyPatch) -> WorkerSettings:
    for key, value in environment(service).items():
        env.setenv(key, value)
    command = service["command"]
    assert command[:3] == ["python", "-m", "kvtier.worker"]
    settings, _ = parse_settings(command[3:])
    return settings


def _proxy_settings(service: dict[str, Any], env: pytest.MonkeyPatch) -> ProxySettings:
    for key, value in environment(service).items():
        env.setenv(key, value)
    command = service["command"]
    assert command[0] == "pdproxy"
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve"
    return settings_from_args(args)


def _health_port(service: dict[str, Any]) -> int:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    code = test[-1]
    compile(code, "<healthcheck>", "exec")  # valid Python
    url = code.split("urlopen('")[1].split("'")[0]
    return int(urlparse(url).port or 80)


def test_services_and_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *WORKERS, "proxy", "locust", "prometheus", "grafana"}
    # One image, built once (docker/images or docker build), named by every service: no
    # service builds (Compose v1 built it once per service).
    for name, service in services.items():
        assert "build" not in service, name
    for name in [*WORKERS, "proxy", "locust"]:
        assert services[name]["image"] == "pdproxy:local"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_images_are_chosen_by_variables() -> None:
    images = {"PDPROXY_IMAGE": "a:1", "REDIS_IMAGE": "b:2", "PROMETHEUS_IMAGE": "c:3"}
    services = load_compose("compose.yaml", images)["services"]
    assert services["proxy"]["image"] == services["producer-0"]["image"] == "a:1"
    assert services["redis"]["image"] == "b:2" and services["prometheus"]["image"] == "c:3"
    official = load_compose("compose.yaml")["services"]
    assert official["redis"]["image"].startswith("redis:")
    assert official["prometheus"]["image"].startswith("prom/prometheus:")


def test_no_top_level_name_compose_v1_rejects_it() -> None:
    for name in ("compose.yaml", "compose.vllm.yaml"):
        assert "name" not in load_compose(name), name


def test_start_order_waits_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    proxy_deps = services["proxy"]["depends_on"]
    assert set(proxy_deps) == {"redis", *WORKERS}
    assert {d["condition"] for d in proxy_deps.values()} == {"service_healthy"}
    assert services["locust"]["depends_on"] == {"proxy": {"condition": "service_healthy"}}
    for name in proxy_deps:
        assert "healthcheck" in services[name], name
    assert "healthcheck" in services["proxy"]


def test_workers_parse_with_the_worker_cli(
    compose: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    secrets = set()
    for name in WORKERS:
        with pytest.MonkeyPatch.context() as env:
            settings = _worker_settings(compose["services"][name], env)
        assert settings.role == name.split("-")[0]
        assert settings.model == "sim" and settings.host == "0.0.0.0"
        assert settings.advertise_host == name and settings.engine_id == name
        assert settings.port == _health_port(compose["services"][name]) == 8100
        assert settings.events_endpoint == "tcp://*:5557" and settings.p2p_port == 5600
        assert settings.sim_decode_ms_per_step > 0
        secrets.add(settings.p2p_secret.get_secret_value())
    assert len(secrets) == 1 and secrets != {""}


def test_proxy_env_is_valid_and_points_at_the_workers(
    compose: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    with pytest.MonkeyPatch.context() as env:
        settings = _proxy_settings(services["proxy"], env)
    with pytest.MonkeyPatch.context() as env:
        worker = _worker_settings(services["producer-0"], env)
    assert settings.host == "0.0.0.0" and settings.port == _health_port(services["proxy"])
    assert services["proxy"]["ports"] == [f"127.0.0.1:8000:{settings.port}"]
    assert settings.router == "kv"
    assert [b.name for b in settings.backends] == WORKERS
    for backend in settings.backends:
        assert backend.role.value == backend.name.split("-")[0]
        assert backend.dialect == "p2p"
        assert backend.url == f"http://{backend.name}:{worker.port}"
        assert backend.events_endpoint == f"tcp://{backend.name}:5557"
    router = settings.router_options
    assert router.index_url is not None and urlparse(router.index_url).hostname == "redis"
    assert router.model_seed == worker.hash_seed and router.block_size == worker.block_size
    assert router.events == {b.name: b.events_endpoint for b in settings.backends}
    assert router.tokenizer.kind == "bytes"


def test_worker_model_is_switched_everywhere_by_one_variable(clean_env: pytest.MonkeyPatch) -> None:
    compose = load_compose("compose.yaml", {"WORKER_MODEL": "tiny"})
    services = compose["services"]
    with pytest.MonkeyPatch.context() as env:
        worker = _worker_settings(services["consumer-1"], env)
    with pytest.MonkeyPatch.context() as env:
        proxy = _proxy_settings(services["proxy"], env)
    assert worker.model == "tiny"
    assert proxy.router_options.model_seed == worker.hash_seed
    assert environment(services["locust"])["LOCUST_MODEL"] == worker.model_name


def test_locust_service_command_runs_with_the_real_locust(
    compose: dict[str, Any], fake_openai_url: str, tmp_path: Path
) -> None:
    service = compose["services"]["locust"]
    assert service["entrypoint"] == ["locust"]
    args = [a.replace("/app/", f"{ROOT}/") for a in service["command"]]
    host = args[args.index("--host") + 1]
    assert urlparse(host).hostname == "proxy" and urlparse(host).port == 8000
    args[args.index("--host") + 1] = fake_openai_url  # no "proxy" host outside compose
    env = {"PATH": str(Path(sys.executable).parent), **environment(service)}
    env["LOCUST_REPORT_JSON"] = str(tmp_path / "locust.json")
    exe = shutil.which("locust", path=env["PATH"])
    assert exe is not None
    proc = subprocess.run(
        [exe, *args, "--headless", "-u", "2", "-r", "2", "-t", "2s", "--only-summary"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    report = json.loads((tmp_path / "locust.json").read_text())
    assert report["workload"] == "shared-prefix", proc.stdout + proc.stderr
    assert report["model_id"] == "kvtier-sim" and report["completed"] > 0
    assert max(report["input_lens"]) > 1024  # the service's system prompt length took effect

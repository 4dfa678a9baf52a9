"""Compose files, read as an attacker would probe them: no placeholder secret, no way to start
without real ones, nothing but the proxy (and Locust) reachable from the host."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.worker.__main__ import parse_settings
from kvtier.worker.peers import PeerAllowlist
from pdproxy.cli import build_parser, settings_from_args
from tests.docker.conftest import (
    DOCKER,
    REQUIRED_SECRETS,
    MissingVariable,
    environment,
    load_compose,
)

FILES = ["compose.yaml", "compose.vllm.yaml"]
FRONT_DOOR = {"proxy", "locust", "prometheus", "grafana"}
"""The only services that publish ports on the host (Prometheus and Grafana on loopback only)."""


@pytest.mark.parametrize("name", FILES)
def test_no_placeholder_secret_anywhere(name: str) -> None:
    text = (DOCKER / name).read_text().lower()
    for placeholder in ("change-me", "changeme", "change_me"):
        assert placeholder not in text


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_each_secret(name: str, value: str | None) -> None:
    for secret in REQUIRED_SECRETS[name]:
        env = {k: v for k, v in REQUIRED_SECRETS[name].items() if k != secret}
        if value is not None:
            env[secret] = value
        with pytest.raises(MissingVariable, match=secret):
            load_compose(name, env, secrets=False)
    load_compose(name, REQUIRED_SECRETS[name], secrets=False)  # all set: it starts


@pytest.mark.parametrize("name", FILES)
def test_only_the_front_door_publishes_ports(name: str) -> None:
    compose = load_compose(name)
    services: dict[str, Any] = compose["services"]
    for service_name, service in services.items():
        if service_name not in FRONT_DOOR:
            assert "ports" not in service, service_name
            assert service.get("network_mode") != "host", service_name
            assert service["networks"] == ["backend"], service_name
    assert set(services["proxy"]["networks"]) == {"front", "backend"}
    for service_name in ("prometheus", "grafana"):
        for port in services.get(service_name, {}).get("ports", []):
            assert port.startswith("127.0.0.1:"), (service_name, port)
    if name == "compose.yaml":
        # Workers and Redis need no route out: their network is internal.
        assert compose["networks"]["backend"] == {"internal": True}
        assert services["locust"]["networks"] == ["front"]


def test_workers_and_proxy_share_the_runs_key_and_consumers_allow_only_producers(
    clean_env: pytest.MonkeyPatch,
) -> None:
    env_values = {"KVTIER_P2P_SECRET": "p" * 40, "KVTIER_WORKER_API_KEY": "w" * 40}
    compose = load_compose("compose.yaml", env_values, secrets=False)
    services = compose["services"]
    workers = {}
    for name in ("producer-0", "producer-1", "consumer-0", "consumer-1"):
        with pytest.MonkeyPatch.context() as env:
            for key, value in environment(services[name]).items():
                env.setenv(key, value)
            workers[name], _ = parse_settings(services[name]["command"][3:])
    for settings in workers.values():
        assert settings.api_key is not None
        assert settings.api_key.get_secret_value() == "w" * 40
        assert settings.p2p_secret.get_secret_value() == "p" * 40
    with pytest.MonkeyPatch.context() as env:
        for key, value in environment(services["proxy"]).items():
            env.setenv(key, value)
        proxy = settings_from_args(build_parser().parse_args(services["proxy"]["command"][1:]))
    for backend in proxy.backends:
        assert backend.api_key is not None and backend.api_key.get_secret_value() == "w" * 40
    for consumer in ("consumer-0", "consumer-1"):
        peers = PeerAllowlist.parse(workers[consumer].p2p_allowed_peers)
        for producer in ("producer-0", "producer-1"):
            p = workers[producer]
            assert p.advertise_host is not None
            assert peers.allows(p.advertise_host, p.p2p_port)
        assert not peers.allows("consumer-1", 5600)  # a consumer is no producer
        assert not peers.allows("redis", 6379) and not peers.allows("producer-0", 6379)


def test_vllm_engines_and_proxy_share_the_api_key(clean_env: pytest.MonkeyPatch) -> None:
    compose = load_compose("compose.vllm.yaml", {"VLLM_API_KEY": "v" * 40}, secrets=False)
    services = compose["services"]
    for engine in ("prefill-0", "decode-0"):
        assert environment(services[engine])["VLLM_API_KEY"] == "v" * 40
    for key, value in environment(services["proxy"]).items():
        clean_env.setenv(key, value)
    proxy = settings_from_args(build_parser().parse_args(services["proxy"]["command"][1:]))
    for backend in proxy.backends:
        assert backend.api_key is not None and backend.api_key.get_secret_value() == "v" * 40


def test_grafana_has_no_default_admin() -> None:
    """An attacker on the host tries Grafana's admin/admin: no admin account exists, and the
    anonymous role cannot edit."""
    grafana = load_compose("compose.yaml")["services"]["grafana"]
    env = environment(grafana)
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert grafana["profiles"] == ["grafana"]  # not started unless asked for


@pytest.mark.parametrize("name", FILES)
def test_every_published_port_is_on_loopback(name: str) -> None:
    """Issue 30: the proxy was published on every interface with no ``api_keys``, so anyone
    on the host's network could send completions (and Locust's UI could start load runs).
    Every published port binds 127.0.0.1: exposing one is an edit, made with keys set."""
    services: dict[str, Any] = load_compose(name)["services"]
    published = [(s, p) for s, service in services.items() for p in service.get("ports", [])]
    assert any(service_name == "proxy" for service_name, _ in published)
    for service_name, port in published:
        assert str(port).startswith("127.0.0.1:"), (service_name, port)

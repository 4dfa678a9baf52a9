"""docker/compose.vllm.yaml: vLLM with NixlConnector and KV events, pdproxy in the NIXL dialect;
its GPU overlay (compose.vllm.gpu.yaml) and the CPU settings the live test runs it with.

vLLM is not installed here, so its flags are checked for shape (the JSON configs parse and say
what the proxy relies on); the proxy side is checked against the real CLI and settings.
tests/docker/test_vllm_stack_live.py runs the file for real on CPUs.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from pdproxy.cli import build_parser, settings_from_args
from pdproxy.settings import Dialect
from tests.docker.conftest import DOCKER, environment, load_compose

ENGINES = {"prefill-0": "producer", "decode-0": "consumer"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose("compose.vllm.yaml", {"MODEL": "org/some-model"})


def _flags(command: list[str]) -> dict[str, str]:
    flags = {}
    for item in command[1:]:
        assert item.startswith("--"), item
        name, _, value = item.partition("=")
        flags[name] = value
    return flags


def test_engines_enable_nixl_prefix_caching_and_kv_events(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"redis", *ENGINES, "proxy"}
    gpus = []
    for name in ENGINES:
        service = services[name]
        assert service["entrypoint"] == ["vllm", "serve"]
        assert service["command"][0] == "org/some-model"
        flags = _flags(service["command"])
        transfer = json.loads(flags["--kv-transfer-config"])
        assert transfer == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cuda",
            "kv_connector_extra_config": {"kv_lease_duration": 30},  # vLLM's default
        }
        events = json.loads(flags["--kv-events-config"])
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert urlparse(events["endpoint"]).port == 5557
        assert "--enable-prefix-caching" in flags and flags["--block-size"] == "16"
        assert flags["--optimization-level"] == "2"  # vLLM's default
        # cached_tokens in usage: the router's drift telemetry (and the live test) read it.
        assert "--enable-prompt-tokens-details" in flags
        assert environment(service)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name
        assert "deploy" not in service  # devices come from the GPU overlay
        assert "healthcheck" in service
    overlay = yaml.safe_load((DOCKER / "compose.vllm.gpu.yaml").read_text())
    assert set(overlay["services"]) == set(ENGINES)
    for service in overlay["services"].values():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        gpus += devices[0]["device_ids"]
    assert sorted(gpus) == ["0", "1"]


CPU = {
    "MODEL": "/models/tiny-llama",
    "VLLM_IMAGE": "pdproxy-vllm-cpu:local",
    "VLLM_BLOCK_SIZE": "128",
    "VLLM_OPTIMIZATION_LEVEL": "0",
    "VLLM_KV_BUFFER_DEVICE": "cpu",
    "VLLM_KV_LEASE_S": "180",
}
"""What the live test sets to run the file on CPUs (docker/images --local --vllm)."""


def test_the_cpu_settings_reach_the_engines_and_the_router() -> None:
    services = load_compose("compose.vllm.yaml", CPU)["services"]
    for name in ENGINES:
        service = services[name]
        assert service["image"] == "pdproxy-vllm-cpu:local"
        flags = _flags(service["command"])
        assert flags["--block-size"] == "128" and flags["--optimization-level"] == "0"
        transfer = json.loads(flags["--kv-transfer-config"])
        assert transfer["kv_buffer_device"] == "cpu"
        assert transfer["kv_connector_extra_config"] == {"kv_lease_duration": 180}
    router = json.loads(environment(services["proxy"])["PDPROXY_ROUTER_OPTIONS"])
    assert router["block_size"] == 128  # the router hashes blocks as the engines cache them


def test_proxy_runs_the_nixl_dialect_in_front_of_the_engines(
    compose: dict[str, Any], clean_env: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    proxy = services["proxy"]
    for key, value in environment(proxy).items():
        clean_env.setenv(key, value)
    args = build_parser().parse_args(proxy["command"][1:])
    settings = settings_from_args(args)
    assert settings.router == "kv"
    assert {b.name: b.role.value for b in settings.backends} == ENGINES
    for backend in settings.backends:
        flags = _flags(services[backend.name]["command"])
        events = json.loads(flags["--kv-events-config"])
        assert backend.dialect is Dialect.NIXL
        assert backend.url == f"http://{backend.name}:{flags['--port']}"
        assert (
            backend.events_endpoint == f"tcp://{backend.name}:{urlparse(events['endpoint']).port}"
        )
    router = settings.router_options
    assert router.tokenizer.kind == "backend"
    assert (
        router.tokenizer.url == "http://prefill-0:8100"
        and router.tokenizer.model == "org/some-model"
    )
    assert router.block_size == 16
    assert set(router.replay) == set(ENGINES)
    assert set(proxy["depends_on"]) == {"redis", *ENGINES}
    assert {d["condition"] for d in proxy["depends_on"].values()} == {"service_healthy"}

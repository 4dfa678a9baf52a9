"""Settings sources and precedence, the router factory, the CLI, and SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from pdproxy.cli import build_parser, settings_from_args
from pdproxy.errors import ConfigError
from pdproxy.routing.factory import build_router
from pdproxy.routing.simple import LeastLoadedRouter, RoundRobinRouter
from pdproxy.settings import Dialect, ProxySettings
from tests.conftest import free_port
from tests.pdproxy.conftest import FakeFactory, eventually

EXAMPLE = Path(__file__).parents[3] / "pdproxy" / "examples" / "proxy.yaml"


def test_example_config_loads() -> None:
    s = ProxySettings(config_file=EXAMPLE)
    assert [b.name for b in s.backends] == ["prefill-0", "decode-0"]
    assert {b.dialect for b in s.backends} == {Dialect.P2P}
    assert s.router == "round_robin"


def test_precedence_file_then_env_then_kwargs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "p.json"
    cfg.write_text(json.dumps({"port": 1111, "timeouts": {"connect_s": 9, "consumer_idle_s": 7}}))
    s = ProxySettings(config_file=cfg)
    assert s.port == 1111 and s.timeouts.connect_s == 9
    monkeypatch.setenv("PDPROXY_PORT", "2222")
    monkeypatch.setenv("PDPROXY_TIMEOUTS__CONNECT_S", "1.5")
    s = ProxySettings(config_file=cfg)
    assert s.port == 2222 and s.timeouts.connect_s == 1.5
    assert s.timeouts.consumer_idle_s == 7  # nested values merge across sources
    assert ProxySettings(config_file=cfg, port=3333).port == 3333


def test_backends_from_env_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "PDPROXY_BACKENDS",
        json.dumps(
            [{"name": "d", "url": "http://h:1/", "role": "consumer", "api_key": "sekrit-42"}]
        ),
    )
    [b] = ProxySettings().backends
    assert b.url == "http://h:1" and b.api_key is not None
    assert "sekrit-42" not in repr(b)  # secrets stay out of logs


@pytest.mark.parametrize(
    "backends",
    [
        [{"name": "a", "url": "http://x", "role": "consumer"}] * 2,
        [{"name": "a", "url": "x:1", "role": "consumer"}],
        [{"name": "bad name", "url": "http://x", "role": "consumer"}],
        [{"name": "a", "url": "http://x", "role": "decoder"}],
        [{"name": "a", "url": "http://x", "role": "consumer", "dialect": "mooncake"}],
    ],
)
def test_invalid_backends_are_refused(backends: list[dict[str, str]]) -> None:
    with pytest.raises(ValidationError):
        ProxySettings(backends=backends)


def test_bad_config_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError):
        ProxySettings(config_file=bad)
    with pytest.raises(ConfigError):
        ProxySettings(config_file=tmp_path / "missing.yaml")


def test_router_factory() -> None:
    assert isinstance(build_router(ProxySettings(router="round_robin")), RoundRobinRouter)
    assert isinstance(build_router(ProxySettings(router="least_loaded")), LeastLoadedRouter)
    with pytest.raises(ValidationError):
        ProxySettings(router="random")


def test_cli_flags_override_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve", "--config", str(EXAMPLE), "--port", "9001", "--router", "least_loaded",
            "--producer", "http://p:1", "--consumer", "http://d:2", "--consumer", "http://d:3",
            "--dialect", "p2p",
        ]
    )  # fmt: skip
    s = settings_from_args(args)
    assert s.port == 9001 and s.router == "least_loaded"
    assert [(b.name, b.url, b.role.value, b.dialect.value) for b in s.backends] == [
        ("producer-0", "http://p:1", "producer", "p2p"),
        ("consumer-0", "http://d:2", "consumer", "p2p"),
        ("consumer-1", "http://d:3", "consumer", "p2p"),
    ]
    assert s.timeouts.consumer_idle_s == 60  # the rest still comes from the file


def test_cli_requires_a_subcommand() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


@pytest.mark.slow
async def test_serve_drains_in_flight_requests_on_sigterm(fake: FakeFactory) -> None:
    d = await fake("D", first_chunk_delay_s=1.0)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pdproxy.cli", "serve", "--port", str(port),
            "--consumer", d.url, "--log-level", "warning",
            # One process: the readiness probe right after SIGTERM may reach a sibling before
            # the supervisor's forwarded signal did (test_serve_workers covers N processes).
            "--workers", "1",
        ],
        env={**os.environ, "PDPROXY_HEALTH__ENABLED": "false", "PDPROXY_DRAIN_DELAY_S": "0.3"},
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for _ in range(300):
                try:
                    if (await c.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
            await eventually(lambda: len(d.received) == 1)
            proc.send_signal(signal.SIGTERM)
            ready = await c.get("/ready")  # within drain_delay_s: still listening, not ready
            assert ready.status_code == 503 and ready.json()["reason"] == "draining"
            r = await slow
            assert r.status_code == 200
            assert r.json()["object"] == "text_completion"
        assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)

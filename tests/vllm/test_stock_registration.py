"""Stock vLLM registers with the proxy's trusted-fabric socket (no CURVE), serves, stops and is
drained.

The sender is vLLM's own, unmodified: ``moriio_heartbeat.py`` from the installed vLLM (the
process vLLM 0.32's MoRIIO connector starts to announce an instance; the P2P NCCL connector that
sent the same message in earlier releases is gone from 0.32), run by vLLM's interpreter with the
payload the connector builds (``MoRIIOConnectorWorker._start_heartbeat``). The MoRIIO connector
itself needs AMD's ``mori`` (ROCm) and cannot load on CPU, so the heartbeat runs beside a plain
vLLM instance, as the connector's own child process runs beside its engine, and is stopped the
way the connector stops it (its stdin closed) when the instance stops.

Its own vLLM instance (stopped by the test), not the package's shared stack.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdproxy.stack.process import ProcessSpec
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import SERVED_NAME, VllmInstance, VllmPaths, VllmRole, vllm_instance
from tests.conftest import free_port
from tests.vllm.conftest import _need_vllm, prompt_ids, vllm_metric

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "stock-registration-admin"
HEARTBEAT_TIMEOUT_S = 10.0
"""vLLM pings every 3 s; generous, as the cores are shared."""


@dataclass
class StockVllm:
    paths: VllmPaths
    instance: VllmInstance
    supervisor: Supervisor
    proxy_url: str
    fabric_endpoint: str

    def members(self) -> list[dict[str, Any]]:
        resp = httpx.get(self.proxy_url + "/admin/members",
                         headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)  # fmt: skip
        assert resp.status_code == 200, resp.text
        members: list[dict[str, Any]] = resp.json()["members"]
        return members


def _heartbeat_file(paths: VllmPaths) -> Path:
    """vLLM's sender, found in the installed package without importing vLLM here."""
    found = sorted(paths.venv.glob("lib/python3*/site-packages/vllm/distributed/kv_transfer/"
                                   "kv_connector/v1/moriio/moriio_heartbeat.py"))  # fmt: skip
    if not found:
        pytest.fail(f"vLLM's moriio_heartbeat.py is not in {paths.venv}: another vLLM release?")
    return found[0]


def _moriio_payload(http_port: int) -> dict[str, Any]:
    """``MoRIIOConnectorWorker._start_heartbeat``'s payload for a decode instance on this host
    (``local_ip`` is the instance's ``VLLM_HOST_IP``, 127.0.0.1 in the stack)."""
    return {
        "type": "D",
        "http_address": f"127.0.0.1:{http_port}",
        "zmq_address": "host:127.0.0.1,handshake:6301,notify:6302",
        "dp_size": 1,
        "tp_size": 1,
        "transfer_mode": "READ",
    }


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StockVllm]:
    paths = _need_vllm()
    run_dir = tmp_path_factory.mktemp("vllm-stock")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    instance = vllm_instance(
        "s0", VllmRole.SINGLE, paths, http_port=free_port(), side_channel_port=None,
        socket_dir=sockets,
    )  # fmt: skip
    fabric_port = free_port()
    config = {
        "host": "127.0.0.1",
        "port": 0,
        "backends": [],
        "router": "round_robin",
        "admin_key": ADMIN,
        "debug_headers": True,
        "health": {"interval_s": 1.0, "healthy_threshold": 1, "unhealthy_threshold": 5},
        "membership": {
            "poll_s": 0.2,
            "drain_grace_s": 1.0,
            "registration": {
                "trusted_fabric": {
                    "endpoint": f"tcp://127.0.0.1:{fabric_port}",
                    "networks": ["127.0.0.1/32"],
                },
                "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                "dialect": "none",
            },
        },
    }
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        supervisor.start([instance.spec])
        supervisor.wait_healthy(600.0)
        port = free_port()
        path = run_dir / "proxy.yaml"
        path.write_text(yaml.safe_dump({**config, "port": port}, sort_keys=False))
        url = f"http://127.0.0.1:{port}"
        argv = (sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path))
        env = {"PYTHONPATH": str(ROOT)}
        # /health, not /ready: with no backend until the registration, it is not ready.
        supervisor.start([ProcessSpec("proxy", argv, url + "/health", env, "proxy")])
        supervisor.wait_healthy(60.0)
        yield StockVllm(paths, instance, supervisor, url, f"tcp://127.0.0.1:{fabric_port}")


def _eventually(check: Any, timeout_s: float, what: Any) -> None:
    """Wait until ``check()`` holds; ``what`` (text, or a callable giving it) says why not."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.5)


def test_stock_vllm_registers_serves_stops_and_is_drained(stock: StockVllm) -> None:
    http_port = int(stock.instance.url.rsplit(":", 1)[1])
    name = f"reg-127.0.0.1-{http_port}"
    sender = subprocess.Popen(
        [str(stock.paths.python), str(_heartbeat_file(stock.paths)), stock.fabric_endpoint,
         "3", "100"],
        stdin=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sender.stdin is not None
        sender.stdin.write(json.dumps(_moriio_payload(http_port)) + "\n")
        sender.stdin.flush()
        _eventually(lambda: [m["name"] for m in stock.members()] == [name], 30, "no registration")
        [member] = stock.members()
        assert member["owner"] == "fabric:127.0.0.1" and member["state"] == "active"
        assert member["role"] == "consumer" and member["url"] == stock.instance.url

        answers: list[str] = []

        def served() -> bool:  # routable once its first health check passed
            body = {"model": SERVED_NAME, "prompt": prompt_ids(700, 40), "max_tokens": 4}
            resp = httpx.post(stock.proxy_url + "/v1/completions", json=body, timeout=300)
            answers.append(f"{resp.status_code} {resp.text[:200]}")
            return resp.status_code == 200

        _eventually(served, 60, lambda: f"the registered vLLM never served: {answers[-3:]}")
        # The registered instance is the proxy's only backend; vLLM counts what it answered.
        assert vllm_metric(stock.instance.url, "vllm:request_success_total") >= 1
        time.sleep(4)  # a few heartbeats: refreshed, still active
        assert stock.members()[0]["state"] == "active"

        # vLLM stops: the engine, and its heartbeat (the connector closes the sender's stdin).
        engine = next(c for c in stock.supervisor.children if c.spec.name == "s0")
        engine.signal_group(signal.SIGTERM)
        assert engine.wait(time.monotonic() + 60) is not None
        sender.stdin.close()
        assert sender.wait(timeout=30) == 0
        _eventually(
            lambda: any(m["state"] == "draining" for m in stock.members()) or not stock.members(),
            HEARTBEAT_TIMEOUT_S + 20,
            "not drained after its heartbeats stopped",
        )
        _eventually(lambda: not stock.members(), 30, "drained but never removed")
        body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2}
        resp = httpx.post(stock.proxy_url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code in (404, 503), resp.text  # nothing left to serve it
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(timeout=10)

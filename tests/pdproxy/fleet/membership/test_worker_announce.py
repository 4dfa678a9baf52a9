"""End to end: a reference worker (``kvtier.worker``, sim model) announces itself to the proxy,
serves under load, is stopped with SIGTERM (it announces leaving, the proxy drains it, its
requests finish, it exits 0) and leaves the registry: no request fails."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.settings import ProxySettings
from tests.conftest import free_port
from tests.pdproxy.conftest import ProxyFactory
from tests.pdproxy.fleet.membership.conftest import RegistrationKeys
from tests.pdproxy.fleet.membership.load import Load
from tests.reliability.procs import ProcessGroup

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    yield group
    for proc in group.procs:
        proc.stop()


def _leg_count(metrics: CollectorRegistry, leg: str, backend: str) -> float:
    value = metrics.get_sample_value(
        "pdproxy_leg_latency_seconds_count", {"leg": leg, "backend": backend}
    )
    return value or 0.0


async def test_worker_announces_serves_and_leaves_under_load(
    registration_keys: RegistrationKeys, procs: ProcessGroup, proxy: ProxyFactory
) -> None:
    static = procs.worker("static", role="both", model="sim")
    registration_port = free_port()
    settings = ProxySettings(
        backends=[{"name": "static", "url": static.url, "role": "both", "dialect": "p2p"}],
        health={"enabled": False},
        retries={"backoff_base_s": 0.001, "backoff_max_s": 0.005},
        membership={
            "poll_s": 0.05,
            "drain_grace_s": 0.3,
            "registration": {
                "endpoint": f"tcp://127.0.0.1:{registration_port}",
                "curve_secret_key_file": str(registration_keys.proxy_secret),
                "curve_clients_dir": str(registration_keys.clients_dir),
                "heartbeat_timeout_s": 2.0,
            },
        },
    )
    running = await proxy(settings)
    registry = running.state.registry
    metrics = running.state.metrics.registry
    async with Load(running.url, concurrency=4, model="kvtier-sim", max_tokens=8) as load:
        await load.until(lambda: load.ok >= 10)
        announcing = procs.worker(
            "announcing",
            role="both",
            model="sim",
            args=[
                "--announce-endpoint", f"tcp://127.0.0.1:{registration_port}",
                "--announce-curve-secret-key-file", str(registration_keys.worker_secret),
                "--announce-curve-server-key-file", str(registration_keys.proxy_public),
                "--announce-interval-s", "0.3",
                "--shutdown-timeout-s", "10",
            ],
        )  # fmt: skip
        name = f"reg-127.0.0.1-{announcing.url.rsplit(':', 1)[1]}"
        t = time.monotonic()
        await load.until(lambda: registry.get(name) is not None, timeout=30)
        log.info("healthy worker to registered: %.2f s", time.monotonic() - t)
        backend = registry.get(name)
        assert backend is not None
        assert backend.role.value == "both" and backend.dialect.value == "p2p"
        assert backend.config.models == ("kvtier-sim",)
        assert backend.kv_address == ("127.0.0.1", announcing.p2p_port)
        await load.until(
            lambda: (
                _leg_count(metrics, "consumer", name) >= 5
                and _leg_count(metrics, "producer", name) >= 5
            ),
            timeout=60,
        )
        t = time.monotonic()
        announcing.signal(signal.SIGTERM)  # leaving → drained → requests finish → removed
        await load.until(lambda: registry.get(name) is None, timeout=30)
        log.info("SIGTERM to removal: %.2f s", time.monotonic() - t)
        assert backend.in_flight == 0
        ok = load.ok
        await load.until(lambda: load.ok >= ok + 20, timeout=60)
        assert announcing.proc is not None
        assert announcing.proc.wait(20) == 0  # a graceful stop
    log.info("load: %d requests sent, %d ok, %d failed", load.sent, load.ok, len(load.failures))
    assert load.failures == []
    assert load.ok == load.sent

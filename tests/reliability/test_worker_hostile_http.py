"""A hostile client on the workers' network, against a real worker process with an API key:
unauthenticated calls, huge ids, huge bodies, a consumer pointed at the attacker.

The finding this pins: 20 ``/v1/kv/release`` calls with 5 MiB ids kept +190 MiB of RSS until
4,096 newer releases. Bound (a product promise, generous for a loaded machine): after the same
attack, RSS is within 64 MiB of the warmed-up baseline.
"""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest

from .procs import ProcessGroup
from .record import Tally
from .resources import Tolerance, parse_metrics, sample_worker, settle

pytestmark = pytest.mark.slow

_KEY = "reliability-key-" + uuid.uuid4().hex
_AUTH = {"authorization": f"Bearer {_KEY}"}
_PROMPT = "A prompt that fills a few blocks of KV on the worker under attack. " * 3
_HUGE_ID = "k" * (5 * 1024 * 1024)


def test_huge_ids_and_bodies_leave_no_memory_behind(procs: ProcessGroup, tally: Tally) -> None:
    worker = procs.worker("w-hostile", api_key=_KEY)
    with httpx.Client(base_url=worker.url, timeout=60) as client:
        body = {"prompt": _PROMPT, "max_tokens": 2}
        assert client.post("/v1/completions", json=body, headers=_AUTH).status_code == 200
        base = sample_worker(worker.url, worker.pid)
        for _ in range(20):
            resp = client.post("/v1/kv/release", json={"kv_request_id": _HUGE_ID}, headers=_AUTH)
            assert resp.status_code == 400, resp.text[:200]
            tally.ok()
            resp = client.post("/v1/kv/release", json={"kv_request_id": _HUGE_ID})
            assert resp.status_code == 401
            tally.ok()
        params = {"remote_decoder": {"kv_request_id": _HUGE_ID}}
        for _ in range(5):
            resp = client.post(
                "/v1/completions", json={**body, "kv_transfer_params": params}, headers=_AUTH
            )
            assert resp.status_code == 400
            tally.ok()
        resp = client.post(
            "/v1/completions", json={"prompt": "x" * (17 * 1024 * 1024)}, headers=_AUTH
        )
        assert resp.status_code == 413
        tally.ok()
        after, leaks = settle(worker.url, worker.pid, base, Tolerance(rss_bytes=64 * 2**20))
        tally.notes.append(f"rss {base.rss / 2**20:.0f} -> {after.rss / 2**20:.0f} MiB")
        assert not leaks, leaks
        gauges = parse_metrics(client.get("/metrics").text)
        assert gauges["kvtier_worker_unauthorized_requests_total"] == 20
        assert gauges["kvtier_worker_kv_params_refused_total"] == 5
        assert gauges["kvtier_worker_oversized_bodies_total"] == 1
        assert gauges["kvtier_worker_p2p_supplies"] == 0


def test_a_consumer_pointed_at_an_attacker_never_connects(
    procs: ProcessGroup, tally: Tally
) -> None:
    """The attacker holds the key (say, a compromised caller) and names its own listener as
    the producer. The consumer allows only the configured producer: 400, no connection."""
    with socket.socket() as attacker:
        attacker.bind(("127.0.0.1", 0))
        attacker.listen(8)
        attacker.setblocking(False)
        port = attacker.getsockname()[1]
        consumer = procs.worker(
            "c-hostile",
            role="consumer",
            api_key=_KEY,
            args=["--p2p-allowed-peer", "producer-0:5600"],
        )
        params = {
            "remote_prefiller": {
                "kv_request_id": uuid.uuid4().hex,
                "remote_host": "127.0.0.1",
                "remote_port": port,
            }
        }
        body = {"prompt": _PROMPT, "max_tokens": 2, "kv_transfer_params": params}
        resp = httpx.post(consumer.url + "/v1/completions", json=body, headers=_AUTH, timeout=60)
        assert resp.status_code == 400 and "p2p_allowed_peers" in resp.text
        tally.ok()
        with pytest.raises(BlockingIOError):
            attacker.accept()  # nobody came
        gauges = parse_metrics(httpx.get(consumer.url + "/metrics", timeout=10).text)
        assert gauges["kvtier_worker_kv_params_refused_total"] == 1

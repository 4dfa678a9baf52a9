"""Data-parallel ranks on real vLLM: one ``--data-parallel-size 2`` instance (two engine cores,
each with its own KV cache) behind a KV-routing proxy, as ``pdproxy up --data-parallel-size 2``
runs it.

vLLM 0.32 cannot publish a rank's KV events on ``ipc://`` (rank 1 dies at start-up) and binds
TCP only on every interface, so its events go to a concrete loopback address where the proxy
listens (``events_listen``), rank ``r`` on the port + ``r``; each batch carries its rank.

Named to run before the package's shared stack starts (file order): its two engine cores start
in about 50 s on a quiet machine, and took 180-235 s beside three running NIXL instances.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from pdproxy.stack.ports import free_port_run
from pdproxy.stack.process import ProcessSpec
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE, VllmRole, proxy_backend, vllm_instance
from pdproxy.stack.vllm_plan import proxy_config
from tests.conftest import free_port
from tests.vllm.conftest import (
    MODEL,
    ROOT,
    STARTUP_TIMEOUT_S,
    _need_vllm,
    _write_proxy,
    prompt_ids,
    route_of,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

RANKS = 2
EVENTS_WITHIN_S = 30.0


@dataclass(frozen=True, slots=True)
class DpStack:
    engine: str
    proxy: str


@pytest.fixture(scope="module")
def dp_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DpStack]:
    paths = _need_vllm()
    run_dir = tmp_path_factory.mktemp("vllm-dp")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    r1 = vllm_instance(
        "dp0", VllmRole.SINGLE, paths, http_port=free_port(), side_channel_port=None,
        socket_dir=sockets, data_parallel_size=RANKS,
        dp_event_ports=(free_port_run(RANKS), free_port_run(RANKS)),
    )  # fmt: skip
    config = proxy_config([proxy_backend(r1)], paths, host="127.0.0.1", port=0)
    # Predictions written at routing time expire at once: a choice made later is the events'.
    config["router_options"]["prediction_ttl_s"] = 0.05
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        # The proxy first: it listens where the ranks' publishers connect; ready (/ready)
        # once it has seen the engine healthy.
        url, argv = _write_proxy(run_dir, "dp", config)
        env = {"PYTHONPATH": str(ROOT)}
        supervisor.start([ProcessSpec("dp-proxy", tuple(argv), url + "/ready", env, "proxy")])
        supervisor.start([r1.spec])
        supervisor.wait_healthy(STARTUP_TIMEOUT_S)
        # vLLM's /health flapped while its DP engines finished starting (the proxy ejected it
        # once, answering 503): wait until a request goes through.
        deadline = time.monotonic() + 120
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}
        while httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 503:
            assert time.monotonic() < deadline, "the proxy never routed to the DP engine"
            time.sleep(1)
        yield DpStack(r1.url, url)


def _complete(url: str, prompt: list[int], rank: int | None = None) -> httpx.Response:
    headers = {"x-pdproxy-debug": "1"}
    if rank is not None:
        headers["x-data-parallel-rank"] = str(rank)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_each_rank_holds_its_prefix_and_the_proxy_routes_to_it(dp_stack: DpStack) -> None:
    for rank in range(RANKS):
        prefix = prompt_ids(700 + rank, 2 * VLLM_BLOCK_SIZE)
        # The rank computes the prefix without the proxy: only its KV events can tell it.
        first = _complete(dp_stack.engine, [*prefix, *prompt_ids(710 + rank, 5)], rank)
        assert first.json()["usage"]["prompt_tokens"] == 2 * VLLM_BLOCK_SIZE + 5
        deadline = time.monotonic() + EVENTS_WITHIN_S
        while True:
            question = [*prefix, *prompt_ids(int(time.monotonic() * 1000), 9)]
            resp = _complete(dp_stack.proxy, question)
            route = route_of(resp)
            # Rank 0 also wins a tie: only a prefix match says the events arrived.
            found = route.get("consumer_rank") == rank and route["reason"] == "kv-prefix"
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert route.get("consumer_rank") == rank, json.dumps(route)
        assert route["reason"] == "kv-prefix", route
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == route["predicted_cached_tokens"] == 2 * VLLM_BLOCK_SIZE
    # Every batch arrived on its rank's socket tagged with that rank: none refused.
    assert _metric(dp_stack.proxy, "pdproxy_kv_router_events_rank_refused_total") == 0
    off = 'pdproxy_kv_router_prediction_checks_total{leg="consumer",result="off"}'
    assert _metric(dp_stack.proxy, off) == 0

"""Real vLLM with kvtier's own KV connector (``kvtier.vllm.connector.KvtierConnector``).

One pair of vLLM instances for this package, started once (about 1.5 minutes): ``p1`` and
``d1``, both ``kv_both`` with the kvtier connector (P2P on loopback, authenticated with a fresh
secret), and a proxy in front in pdproxy's ``p2p`` dialect, always disaggregating (``p1`` →
``d1``). ``d1`` runs with ``offload_prompts`` (every prompt it computes lands in its host pages,
so it can answer ``remote_kv_source`` offers); ``p1`` without. Reference outputs come from the
same instances with a fresh ``cache_salt``: vLLM then computes the whole prompt itself (no
prefix-cache hit, no connector).

The test that kills ``p1`` runs last (file order: ``test_connector_producer_killed.py``).
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdproxy.stack.process import ChildProcess, ProcessSpec
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import (
    VllmConnector,
    VllmInstance,
    VllmRole,
    proxy_backend,
    vllm_instance,
)
from pdproxy.stack.vllm_plan import proxy_config
from tests.conftest import free_port
from tests.vllm.conftest import MODEL, _need_vllm, vllm_metric

ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 600.0

PAGE_BYTES = 2 * 2 * 128 * 2 * 32 * 2
"""One kvtier page of the tiny model: 2 layers x 2 KV heads x 128 tokens x (K+V) x 32 x bf16."""


@dataclass(frozen=True, slots=True)
class KvtierStack:
    instances: dict[str, VllmInstance]
    pd_url: str
    """Proxy (p2p dialect): producer p1, consumer d1, always disaggregated."""
    supervisor: Supervisor
    p2p_secret: str

    def url(self, name: str) -> str:
        return self.instances[name].url

    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.supervisor.children if c.spec.name == name)


@pytest.fixture(scope="package")
def kvtier_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvtierStack]:
    paths = _need_vllm()
    run_dir = tmp_path_factory.mktemp("vllm-kvtier")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    secret = secrets.token_hex(16)
    p2p_ports = {"p1": free_port(), "d1": free_port()}
    instances = {
        name: vllm_instance(
            name,
            role,
            paths,
            http_port=free_port(),
            side_channel_port=None,
            socket_dir=sockets,
            connector=VllmConnector.KVTIER,
            p2p_port=p2p_ports[name],
            p2p_secret=secret,
            # d1 also holds what it computes alone (remote_kv_source from d1 finds it).
            kvtier_options={"offload_prompts": True} if name == "d1" else None,
        )
        for name, role in (("p1", VllmRole.PRODUCER), ("d1", VllmRole.CONSUMER))
    }
    config = proxy_config(
        [proxy_backend(i) for i in instances.values()], paths, host="127.0.0.1", port=0
    )
    # Always disaggregated, also once the TTFT model is warm (`ttft.bypass` unset follows this).
    config["router_options"]["local_prefill"] = {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}
    started = time.monotonic()
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        supervisor.start([i.spec for i in instances.values()])
        supervisor.wait_healthy(STARTUP_TIMEOUT_S)
        port = free_port()  # picked after vLLM bound its own ephemeral ports
        path = run_dir / "pd.yaml"
        # The tests read /metrics right after what they count: no merge cache (metrics_cache_s).
        config = {**config, "port": port, "metrics_cache_s": 0}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        url = f"http://127.0.0.1:{port}"
        argv = (sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path))
        env = {"PYTHONPATH": str(ROOT)}
        supervisor.start([ProcessSpec("pd-proxy", argv, url + "/ready", env, "proxy")])
        supervisor.wait_healthy(60.0)
        print(f"\nkvtier vLLM pair up in {time.monotonic() - started:.0f} s ({run_dir / 'logs'})")
        yield KvtierStack(instances, url, supervisor, secret)


def complete(url: str, prompt: list[int], *, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    """A greedy completion; the JSON answer (asserts HTTP 200)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    resp = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def single_node_tokens(stack: KvtierStack, prompt: list[int]) -> list[int]:
    """The prompt computed by one instance alone: a fresh cache salt defeats every cache."""
    answer = complete(stack.url("d1"), prompt, cache_salt=secrets.token_hex(8))
    tokens: list[int] = answer["choices"][0]["token_ids"]
    return tokens


class Counters:
    """Deltas of kvtier's and vLLM's counters on one instance since construction."""

    NAMES = (
        "vllm:kvtier_blocks_supplied_total",
        "vllm:kvtier_blocks_stored_total",
        "vllm:kvtier_blocks_fetched_total",
        "vllm:kvtier_fetch_bytes_total",
        "vllm:kvtier_fetch_seconds_total",
        "vllm:kvtier_blocks_loaded_total",
        "vllm:kvtier_blocks_recomputed_total",
        "vllm:kvtier_fetch_failures_total",
        "vllm:external_prefix_cache_hits_total",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = {n: vllm_metric(url, n) for n in self.NAMES}

    def delta(self) -> dict[str, float]:
        return {
            n.removeprefix("vllm:").removesuffix("_total"): vllm_metric(self.url, n) - v
            for n, v in self.before.items()
        }


LEAK_GAUGES = (
    "vllm:kvtier_supplies",
    "vllm:kvtier_supply_pages",
    "vllm:kvtier_host_referenced_pages",
    "vllm:kvtier_loads_in_flight",
)


SETTLE_S = 30.0
"""How long leak gauges may take to read zero: past kvtier's ``offer_lease_s`` (10 s), because
an offer a frozen holder answers only after its puller gave up opens a supply that nobody
fetches or releases, and only its lease ends it (by design: an offer's supply outlives the
session that asked, since vLLM's scheduler offers on one connection and its worker fetches on
another)."""


def settled_gauges(url: str, within_s: float = SETTLE_S) -> dict[str, float]:
    """kvtier's leak gauges once they read zero (or the last reading after ``within_s``).

    Gauges are refreshed by engine steps, and a consumer's ``done`` reaches the producer after
    the answer: a one-token request forces a step; polling bounds the wait."""
    gauges: dict[str, float] = {}
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        complete(url, [7, 8, 9], max_tokens=1, cache_salt=secrets.token_hex(8))
        gauges = {g: vllm_metric(url, g) for g in LEAK_GAUGES}
        if not any(gauges.values()):
            break
        time.sleep(0.25)
    return gauges

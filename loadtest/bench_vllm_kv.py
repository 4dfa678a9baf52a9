"""KV transfer inside real vLLM: kvtier's connector (kvtier P2P) vs vLLM's NixlConnector.

One run starts two vLLM pairs side by side: ``p0 → d0`` with NixlConnector (CPU KV buffer, UCX
over loopback) and ``p1 → d1`` with ``kvtier.vllm.connector.KvtierConnector``. Every round sends
one fresh prompt to both pairs, in ABBA order so the shared machine's noise falls on both: the
producer leg (one token), then the consumer leg (one token) that pulls the prompt's KV. Direct
legs, no proxy: only the connectors differ.

Printed per connector:

- bytes moved and transfer seconds as each connector measures them (NIXL:
  ``vllm:nixl_bytes_transferred`` / ``vllm:nixl_xfer_time_seconds`` sums; kvtier:
  ``vllm:kvtier_fetch_bytes_total`` / ``vllm:kvtier_fetch_seconds_total``, from fetch start to
  the last verified block), and their ratio, bytes/s;
- the consumer leg's latency (HTTP request to answer: transfer, install, one token), p50/p90;
- kvtier/NIXL ratios of both.

The two clocks are not the same instrument (NIXL's telemetry times its READ; kvtier's times the
whole fetch, handshake of a fresh session included), so the consumer-leg latency is the
system-level comparison. Asserts nothing.

    python -m loadtest.bench_vllm_kv [--rounds 8] [--prompt-tokens 1920]

Needs ``scripts/dev vllm-setup`` (``PDPROXY_VLLM_VENV`` / ``PDPROXY_VLLM_MODEL_DIR`` as there).
"""

from __future__ import annotations

import argparse
import random
import re
import secrets
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import (
    SERVED_NAME,
    VllmConnector,
    VllmInstance,
    VllmPaths,
    VllmRole,
    free_fixed_port,
    vllm_instance,
)

NIXL_PRODUCER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
NIXL_METRICS = ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum")
KVTIER_METRICS = ("vllm:kvtier_fetch_bytes_total", "vllm:kvtier_fetch_seconds_total")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")


@dataclass(slots=True)
class Side:
    name: str
    producer: VllmInstance
    consumer: VllmInstance
    metrics: tuple[str, str]
    nbytes: float = 0.0
    seconds: float = 0.0
    leg_s: list[float] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(client: httpx.Client, url: str, name: str) -> float:
    total = 0.0
    for line in client.get(url + "/metrics").text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] == name:
            total += float(m["value"])
    return total


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(url + "/v1/completions", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
    answer: dict[str, Any] = resp.json()
    return answer


def one_round(client: httpx.Client, side: Side, prompt: list[int]) -> None:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if side.name == "nixl":
        produced = _post(
            client, side.producer.url, {**body, "kv_transfer_params": NIXL_PRODUCER_PARAMS}
        )
        consumer_params = produced["kv_transfer_params"]
    else:
        kv_request_id = uuid.uuid4().hex
        params = {"remote_decoder": {"kv_request_id": kv_request_id}}
        answer = _post(client, side.producer.url, {**body, "kv_transfer_params": params})
        kvp = answer["kv_transfer_params"]
        consumer_params = {
            "remote_prefiller": {
                "kv_request_id": kv_request_id,
                "remote_host": kvp["remote_host"],
                "remote_port": kvp["remote_port"],
                "remote_engine_id": kvp["remote_engine_id"],
            }
        }
    before = [metric(client, side.consumer.url, m) for m in side.metrics]
    t0 = time.perf_counter()
    _post(client, side.consumer.url, {**body, "kv_transfer_params": consumer_params})
    side.leg_s.append(time.perf_counter() - t0)
    # Connector telemetry reaches /metrics with the engine's next stats update.
    for _ in range(50):
        after = [metric(client, side.consumer.url, m) for m in side.metrics]
        if after[0] > before[0]:
            break
        time.sleep(0.1)
    side.nbytes += after[0] - before[0]
    side.seconds += after[1] - before[1]


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(nixl: Side, kvtier: Side) -> str:
    rows = [f"{'connector':<10} {'MiB moved':>10} {'xfer s':>8} {'MiB/s':>8} "
            f"{'leg p50 ms':>11} {'leg p90 ms':>11}"]  # fmt: skip
    rate = {}
    for s in (nixl, kvtier):
        rate[s.name] = s.nbytes / s.seconds if s.seconds else float("nan")
        rows.append(
            f"{s.name:<10} {s.nbytes / 2**20:>10.2f} {s.seconds:>8.3f} "
            f"{rate[s.name] / 2**20:>8.1f} {_pct(s.leg_s, 0.5) * 1e3:>11.0f} "
            f"{_pct(s.leg_s, 0.9) * 1e3:>11.0f}"
        )
    rows.append(
        f"kvtier/nixl: bytes/s {rate['kvtier'] / rate['nixl']:.2f}, consumer leg p50 "
        f"{_pct(kvtier.leg_s, 0.5) / _pct(nixl.leg_s, 0.5):.2f} (rounds: {len(nixl.leg_s)})"
    )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_vllm_kv", description=__doc__)
    parser.add_argument("--rounds", type=int, default=8, help="prompts, each sent to both (8)")
    parser.add_argument("--prompt-tokens", type=int, default=1920, help="1920: 15 blocks")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    paths = VllmPaths.resolve()
    problem = paths.problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-kv-"))
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    secret = secrets.token_hex(16)

    picked: set[int] = set()

    def make(name: str, role: VllmRole, connector: VllmConnector) -> VllmInstance:
        kvtier = connector is VllmConnector.KVTIER
        p2p_port = None
        if kvtier:
            p2p_port = free_fixed_port(exclude=picked)
            picked.add(p2p_port)
        return vllm_instance(
            name,
            role,
            paths,
            http_port=_free_port(),
            side_channel_port=None if kvtier else _free_port(),
            socket_dir=sockets,
            connector=connector,
            p2p_port=p2p_port,
            p2p_secret=secret if kvtier else None,
        )

    nixl = Side(
        "nixl",
        make("p0", VllmRole.PRODUCER, VllmConnector.NIXL),
        make("d0", VllmRole.CONSUMER, VllmConnector.NIXL),
        NIXL_METRICS,
    )
    kvtier = Side(
        "kvtier",
        make("p1", VllmRole.PRODUCER, VllmConnector.KVTIER),
        make("d1", VllmRole.CONSUMER, VllmConnector.KVTIER),
        KVTIER_METRICS,
    )
    rng = random.Random(0)
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        print(f"starting 4 vLLM instances (logs in {run_dir}/logs) ...", flush=True)
        started = time.monotonic()
        supervisor.start([i.spec for s in (nixl, kvtier) for i in (s.producer, s.consumer)])
        supervisor.wait_healthy(args.startup_timeout)
        print(f"up in {time.monotonic() - started:.0f} s", flush=True)
        with httpx.Client(timeout=300.0, trust_env=False) as client:
            for i in range(args.rounds):
                prompt = [rng.randrange(3, 500) for _ in range(args.prompt_tokens)]
                for side in (nixl, kvtier) if i % 2 == 0 else (kvtier, nixl):
                    one_round(client, side, prompt)
        print(report(nixl, kvtier))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

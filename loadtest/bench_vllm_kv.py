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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from loadtest import vllm_fleet
from loadtest.serving_metrics import nearest_rank
from pdproxy.stack.vllm_engine import VllmConnector, VllmInstance, VllmPaths, VllmRole

NIXL_METRICS = ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum")
KVTIER_METRICS = ("vllm:kvtier_fetch_bytes_total", "vllm:kvtier_fetch_seconds_total")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")


@dataclass(slots=True)
class Side:
    connector: VllmConnector
    producer: VllmInstance
    consumer: VllmInstance
    metrics: tuple[str, str]
    nbytes: float = 0.0
    seconds: float = 0.0
    leg_s: list[float] = field(default_factory=list)

    @classmethod
    def build(
        cls, fleet: vllm_fleet.VllmFleet, n: int, connector: VllmConnector, metrics: tuple[str, str]
    ) -> Side:
        """Producer ``p{n}`` and consumer ``d{n}``, both with ``connector``."""
        producer = fleet.instance(f"p{n}", VllmRole.PRODUCER, connector)
        consumer = fleet.instance(f"d{n}", VllmRole.CONSUMER, connector)
        return cls(connector, producer, consumer, metrics)

    @property
    def name(self) -> str:
        return self.connector.value


def metric(client: httpx.Client, url: str, name: str) -> float:
    total = 0.0
    for line in client.get(url + "/metrics").text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"] == name:
            total += float(m["value"])
    return total


def one_round(client: httpx.Client, side: Side, prompt: list[int]) -> None:
    _, produced = vllm_fleet.producer_leg(client, side.producer.url, side.connector, prompt)
    params = vllm_fleet.consumer_params(side.connector, produced)
    before = [metric(client, side.consumer.url, m) for m in side.metrics]
    leg_s, _ = vllm_fleet.timed_completion(
        client, side.consumer.url, vllm_fleet.one_token(prompt, params)
    )
    side.leg_s.append(leg_s)
    # Connector telemetry reaches /metrics with the engine's next stats update.
    for _ in range(50):
        after = [metric(client, side.consumer.url, m) for m in side.metrics]
        if after[0] > before[0]:
            break
        time.sleep(0.1)
    side.nbytes += after[0] - before[0]
    side.seconds += after[1] - before[1]


def report(nixl: Side, kvtier: Side) -> str:
    rows = [f"{'connector':<10} {'MiB moved':>10} {'xfer s':>8} {'MiB/s':>8} "
            f"{'leg p50 ms':>11} {'leg p90 ms':>11}"]  # fmt: skip
    rate = {}
    for s in (nixl, kvtier):
        rate[s.name] = s.nbytes / s.seconds if s.seconds else float("nan")
        rows.append(
            f"{s.name:<10} {s.nbytes / 2**20:>10.2f} {s.seconds:>8.3f} "
            f"{rate[s.name] / 2**20:>8.1f} {nearest_rank(s.leg_s, 0.5) * 1e3:>11.0f} "
            f"{nearest_rank(s.leg_s, 0.9) * 1e3:>11.0f}"
        )
    leg_ratio = nearest_rank(kvtier.leg_s, 0.5) / nearest_rank(nixl.leg_s, 0.5)
    rows.append(
        f"kvtier/nixl: bytes/s {rate['kvtier'] / rate['nixl']:.2f}, consumer leg p50 "
        f"{leg_ratio:.2f} (rounds: {len(nixl.leg_s)})"
    )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_vllm_kv", description=__doc__)
    parser.add_argument("--rounds", type=int, default=8, help="prompts, each sent to both (8)")
    parser.add_argument("--prompt-tokens", type=int, default=1920, help="1920: 15 blocks")
    return vllm_fleet.run_with_vllm(parser, argv, _run)


def _run(args: argparse.Namespace, paths: VllmPaths) -> int:
    fleet = vllm_fleet.VllmFleet.create(paths, "bench-vllm-kv-")
    nixl = Side.build(fleet, 0, VllmConnector.NIXL, NIXL_METRICS)
    kvtier = Side.build(fleet, 1, VllmConnector.KVTIER, KVTIER_METRICS)
    rng = random.Random(0)
    print(f"starting 4 vLLM instances (logs in {fleet.run_dir}/logs) ...", flush=True)
    started = time.monotonic()
    instances = [i for s in (nixl, kvtier) for i in (s.producer, s.consumer)]
    with fleet.running(instances, args.startup_timeout) as client:
        print(f"up in {time.monotonic() - started:.0f} s", flush=True)
        for i in range(args.rounds):
            prompt = [rng.randrange(3, 500) for _ in range(args.prompt_tokens)]
            for side in (nixl, kvtier) if i % 2 == 0 else (kvtier, nixl):
                one_round(client, side, prompt)
        print(report(nixl, kvtier))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

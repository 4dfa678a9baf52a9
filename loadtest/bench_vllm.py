"""pdproxy in front of real vLLM (CPU, NIXL) vs a client that calls both vLLM legs itself.

One run starts a vLLM producer and consumer (NixlConnector, CPU KV buffer) and ``pdproxy serve``
in front of them (KV-aware router, as ``pdproxy up --engine vllm`` configures it), then sends the
same kind of request both ways, interleaved (ABBA order) so the machine's noise falls on both:

- direct: the client sends the producer leg (``do_remote_decode``, one token, not streamed),
  then the consumer leg with the producer's ``kv_transfer_params`` verbatim, streamed;
- proxy: the client sends one streamed request to pdproxy.

Every request has a fresh prompt (cold prefix caches everywhere), long enough that the router
disaggregates. Prints TTFT (first content chunk) and end-to-end latency, p50 and p90, and the
proxy/direct ratios. Asserts nothing; on two shared cores vLLM's legs vary a lot, so read the
ratios, not the absolute numbers.

    python -m loadtest.bench_vllm [--requests 12] [--prompt-tokens 640] [--max-tokens 16]

Needs ``scripts/dev vllm-setup`` (``PDPROXY_VLLM_VENV`` / ``PDPROXY_VLLM_MODEL_DIR`` as there).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from loadtest.serving_metrics import nearest_rank
from loadtest.vllm_fleet import run_with_vllm
from pdproxy.stack.plan import StackOptions
from pdproxy.stack.ports import free_port
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import SERVED_NAME, VllmPaths
from pdproxy.stack.vllm_plan import build_vllm_plan

PRODUCER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    e2e_s: float
    disaggregated: bool


def _stream(client: httpx.Client, url: str, body: dict[str, Any], t0: float) -> tuple[float, str]:
    """POST a streamed completion; the time of its first content chunk and its headers' timing."""
    first = 0.0
    with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            # The first token's chunk, even when its text is "" (a byte-level token that ends
            # inside a UTF-8 sequence shows no text yet).
            if not first and line.startswith("data: {") and orjson.loads(line[6:]).get("choices"):
                first = time.perf_counter() - t0
        return first or time.perf_counter() - t0, resp.headers.get("server-timing", "")


def direct(client: httpx.Client, producer: str, consumer: str, body: dict[str, Any]) -> Sample:
    t0 = time.perf_counter()
    leg = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": PRODUCER_PARAMS}
    leg.pop("stream_options", None)
    resp = client.post(producer + "/v1/completions", json=leg)
    resp.raise_for_status()
    params = resp.json()["kv_transfer_params"]
    ttft, _ = _stream(
        client, consumer + "/v1/completions", {**body, "kv_transfer_params": params}, t0
    )
    return Sample(ttft, time.perf_counter() - t0, disaggregated=True)


def proxied(client: httpx.Client, proxy: str, body: dict[str, Any]) -> Sample:
    t0 = time.perf_counter()
    ttft, timing = _stream(client, proxy + "/v1/completions", body, t0)
    return Sample(ttft, time.perf_counter() - t0, disaggregated="producer" in timing)


def report(direct_s: Sequence[Sample], proxy_s: Sequence[Sample]) -> str:
    rows = [f"{'metric':<10} {'direct p50':>11} {'proxy p50':>10} {'ratio':>6} "
            f"{'direct p90':>11} {'proxy p90':>10} {'ratio':>6}"]  # fmt: skip
    for name, field in (("TTFT ms", "ttft_s"), ("E2E ms", "e2e_s")):
        d = [float(getattr(s, field)) * 1e3 for s in direct_s]
        p = [float(getattr(s, field)) * 1e3 for s in proxy_s]
        d50, p50, d90, p90 = (
            nearest_rank(d, 0.5),
            nearest_rank(p, 0.5),
            nearest_rank(d, 0.9),
            nearest_rank(p, 0.9),
        )
        rows.append(f"{name:<10} {d50:>11.0f} {p50:>10.0f} {p50 / d50:>6.2f} "
                    f"{d90:>11.0f} {p90:>10.0f} {p90 / d90:>6.2f}")  # fmt: skip
    pd = sum(s.disaggregated for s in proxy_s)
    mean_ms = statistics.fmean(s.e2e_s for s in direct_s) * 1e3
    rows.append(f"requests: {len(direct_s)} direct, {len(proxy_s)} proxied ({pd} disaggregated); "
                f"mean E2E direct {mean_ms:.0f} ms")  # fmt: skip
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_vllm", description=__doc__)
    parser.add_argument("--requests", type=int, default=12, help="per side (12)")
    parser.add_argument("--prompt-tokens", type=int, default=640)
    parser.add_argument("--max-tokens", type=int, default=16)
    return run_with_vllm(parser, argv, _run)


def _run(args: argparse.Namespace, paths: VllmPaths) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    options = StackOptions(port=free_port())
    plan = build_vllm_plan(options, paths, run_dir)
    plan.config_path.write_text(yaml.safe_dump(plan.proxy_config, sort_keys=False))
    producer, consumer = (b["url"] for b in plan.proxy_config["backends"])
    rng = random.Random(0)
    with Supervisor(run_dir / "logs", stop_grace_s=15.0) as supervisor:
        print(f"starting vLLM producer + consumer and pdproxy (logs in {run_dir}/logs) ...")
        started = time.monotonic()
        supervisor.start(plan.workers)
        supervisor.wait_healthy(args.startup_timeout)
        supervisor.start([plan.proxy])
        supervisor.wait_healthy(60.0)
        print(f"up in {time.monotonic() - started:.0f} s")
        samples: dict[str, list[Sample]] = {"direct": [], "proxy": []}
        with httpx.Client(timeout=300.0, trust_env=False) as client:
            for i in range(args.requests):
                order = ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct")
                for side in order:
                    body = {
                        "model": SERVED_NAME,
                        "prompt": [rng.randrange(3, 500) for _ in range(args.prompt_tokens)],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    if side == "direct":
                        sample = direct(client, producer, consumer, body)
                    else:
                        sample = proxied(client, plan.endpoint, body)
                    samples[side].append(sample)
        print(report(samples["direct"], samples["proxy"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

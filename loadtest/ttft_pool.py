"""The mixed-speed pool of :mod:`loadtest.bench_ttft` and the proxies put in front of it.

Four ``sim`` reference workers whose speeds no configuration tells the proxies (``POOL``, scaled
by ``--prefill-ms``/``--step-ms``), pdproxy configured with or without predicted TTFT, and
vllm-router in PD mode, each a child process stopped when its block ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.child import child_process
from pdproxy.stack.ports import free_port

MODEL = "kvtier-sim"
BLOCK = 16
KEYS = {"interactive": "bench-interactive-key-0123456789", "batch": "bench-batch-key-0123456789ab"}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    name: str
    role: str
    prefill_ms: float
    step_ms: float


@dataclass(frozen=True, slots=True)
class Worker:
    spec: WorkerSpec
    url: str
    events: str
    replay: str


def worker_argv(w: Worker, port: int, pages: tuple[int, int] = (4096, 4096)) -> list[str]:
    """``pages``: the worker's KV pages on its device and in host memory."""
    s = w.spec
    return [sys.executable, "-m", "kvtier.worker", "--role", s.role, "--model", "sim",
            "--host", "127.0.0.1", "--port", str(port), "--events-endpoint", w.events,
            "--events-replay-endpoint", w.replay, "--engine-id", s.name,
            "--sim-prefill-ms-per-token", str(s.prefill_ms),
            "--sim-decode-ms-per-step", str(s.step_ms), "--num-pages", str(pages[0]),
            "--host-pages", str(pages[1]), "--log-level", "warning"]  # fmt: skip


def proxy_config(workers: list[Worker], port: int, ttft: dict[str, Any]) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "port": port,
        "router": "kv",
        "debug_headers": True,
        "workers": 1,  # one router state: the learned rates and backlog are per process
        "health": {"interval_s": 1.0, "healthy_threshold": 1, "unhealthy_threshold": 3},
        "api_keys": [{"key": KEYS[k], "ttft_class": k} for k in KEYS],
        "tenants": {"share_prefixes": True},
        "backends": [
            {
                "name": w.spec.name,
                "url": w.url,
                "role": w.spec.role,
                "dialect": "nixl",
                "events_endpoint": w.events,
                "events_replay_endpoint": w.replay,
            }
            for w in workers
        ],
        "router_options": {
            "model_seed": f"{MODEL}/seed=0",
            "block_size": BLOCK,
            "tokenizer": {"kind": "bytes"},
            "ttft": ttft,
        },
    }


def ttft_options(enabled: bool, target_ms: float, batch_ms: float) -> dict[str, Any]:
    return {
        "enabled": enabled,
        "classes": {
            "interactive": {"target_ms": target_ms},
            "batch": {
                "target_ms": batch_ms,
                "sheddable": True,
                "yields": True,
                "placement": "headroom",
            },
        },
    }


def router_argv(binary: Path, port: int, workers: list[Worker], policy: str) -> list[str]:
    argv = [str(binary), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--max-concurrent-requests", "1024",
            "--queue-size", "1024", "--prometheus-port", str(free_port())]  # fmt: skip
    for w in workers:
        if w.spec.role == "producer":
            argv += ["--prefill", w.url]
    for w in workers:
        if w.spec.role == "consumer":
            argv += ["--decode", w.url]
    return argv


POOL = (
    WorkerSpec("p0", "producer", 1.0, 1.0),
    WorkerSpec("p1", "producer", 3.0, 1.0),
    WorkerSpec("c0", "consumer", 1.0, 1.0),
    WorkerSpec("c1", "consumer", 1.0, 2.0),
)
"""Speeds as multiples of ``--prefill-ms`` (prefill time per token) and ``--step-ms``."""


@contextlib.contextmanager
def cluster(args: argparse.Namespace, tmp: Path) -> Iterator[list[Worker]]:
    scaled = [WorkerSpec(s.name, s.role, s.prefill_ms * args.prefill_ms, s.step_ms * args.step_ms)
              for s in POOL]  # fmt: skip
    with workers_of(scaled, tmp) as workers:
        yield workers


@contextlib.contextmanager
def workers_of(
    specs: Sequence[WorkerSpec], tmp: Path, pages: tuple[int, int] = (4096, 4096)
) -> Iterator[list[Worker]]:
    """One sim worker per spec (speeds as given, in ms), stopped when the block ends."""
    workers = []
    with contextlib.ExitStack() as stack:
        for spec in specs:
            port = free_port()
            w = Worker(spec, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}",
                       f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
            argv = worker_argv(w, port, pages)
            stack.enter_context(child_process(argv, log=tmp / f"{spec.name}.log"))
            workers.append(w)
        yield workers


@contextlib.contextmanager
def proxy(name: str, argv: list[str], tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = int(argv[argv.index("--port") + 1])
    env = {**os.environ}
    env.pop("PDPROXY_WORKERS", None)
    with child_process(argv, env=env, log=tmp / f"{name}.log") as proc:
        yield f"http://127.0.0.1:{port}", proc


def pdproxy_argv(config: dict[str, Any], tmp: Path, name: str) -> list[str]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path),
            "--port", str(config["port"]), "--log-level", "warning"]  # fmt: skip


async def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 180.0
) -> None:
    """Workers import torch: on a loaded machine that takes a while."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never became ready")

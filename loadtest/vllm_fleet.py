"""Real vLLM instances one benchmark run starts on loopback and sends its PD legs to directly
(no proxy): their launch under one supervisor, and the one-token legs in both connectors'
dialects (NIXL's ``do_remote_decode``, kvtier's ``remote_decoder``/``remote_prefiller``).

Used by :mod:`loadtest.bench_vllm_kv` and :mod:`loadtest.bench_vllm_pull` (and the command
line check of :mod:`loadtest.bench_vllm`). Needs ``scripts/dev vllm-setup``
(``PDPROXY_VLLM_VENV`` / ``PDPROXY_VLLM_MODEL_DIR`` as there).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdproxy.request.legs import KvRequestId, producer_kv_params
from pdproxy.settings import Dialect
from pdproxy.stack.ports import free_port
from pdproxy.stack.supervisor import Supervisor
from pdproxy.stack.vllm_engine import (
    SERVED_NAME,
    VllmConnector,
    VllmInstance,
    VllmPaths,
    VllmRole,
    vllm_instance,
)


def run_with_vllm(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    bench: Callable[[argparse.Namespace, VllmPaths], int],
) -> int:
    """``bench``'s exit status, once ``parser`` (plus ``--startup-timeout``) has read ``argv``;
    2 when vLLM is not set up here, saying why on stderr."""
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    paths = VllmPaths.resolve()
    problem = paths.problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return bench(args, paths)


@dataclass(slots=True)
class VllmFleet:
    """The instances of one run: logs and event sockets under ``run_dir``, one P2P secret."""

    paths: VllmPaths
    run_dir: Path
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    """kvtier P2P ports picked for instances that have not bound them yet."""

    @classmethod
    def create(cls, paths: VllmPaths, prefix: str) -> VllmFleet:
        """A fleet whose files go in a fresh temporary folder named ``prefix…``."""
        run_dir = Path(tempfile.mkdtemp(prefix=prefix))
        (run_dir / "sockets").mkdir(mode=0o700)
        return cls(paths, run_dir)

    def instance(self, name: str, role: VllmRole, connector: VllmConnector) -> VllmInstance:
        """One instance on free ports: a P2P port (kvtier) or a NIXL side channel."""
        kvtier = connector is VllmConnector.KVTIER
        p2p_port = None
        if kvtier:
            p2p_port = free_port()
        return vllm_instance(
            name,
            role,
            self.paths,
            http_port=free_port(),
            side_channel_port=None if kvtier else free_port(),
            socket_dir=self.run_dir / "sockets",
            connector=connector,
            p2p_port=p2p_port,
            p2p_secret=self.secret if kvtier else None,
        )

    @contextlib.contextmanager
    def running(
        self, instances: Sequence[VllmInstance], startup_timeout_s: float
    ) -> Iterator[httpx.Client]:
        """``instances`` started and healthy, and a client for them, until the block ends."""
        with Supervisor(self.run_dir / "logs", stop_grace_s=15.0) as supervisor:
            supervisor.start([i.spec for i in instances])
            supervisor.wait_healthy(startup_timeout_s)
            with httpx.Client(timeout=300.0, trust_env=False) as client:
                yield client


def _producer_params(connector: VllmConnector, kv_request_id: str) -> dict[str, Any]:
    """A producer leg's ``kv_transfer_params``, as the proxy sends them (``kv_request_id``
    names kvtier's supply; NIXL's producer names none)."""
    dialect = Dialect.P2P if connector is VllmConnector.KVTIER else Dialect.NIXL
    return producer_kv_params(dialect, KvRequestId(kv_request_id))


def producer_leg(
    client: httpx.Client, url: str, connector: VllmConnector, prompt: list[int]
) -> tuple[float, dict[str, Any]]:
    """A producer leg of ``prompt`` (a fresh supply id): its seconds and its answer's
    ``kv_transfer_params``."""
    params = _producer_params(connector, uuid.uuid4().hex)
    seconds, answer = timed_completion(client, url, one_token(prompt, params))
    produced: dict[str, Any] = answer["kv_transfer_params"]
    return seconds, produced


def consumer_params(connector: VllmConnector, produced: dict[str, Any]) -> dict[str, Any]:
    """The consumer leg's ``kv_transfer_params`` from the producer leg's (``produced``): NIXL's
    verbatim; kvtier's name the supply and the producer's P2P server."""
    if connector is VllmConnector.NIXL:
        return produced
    return {
        "remote_prefiller": {
            "kv_request_id": produced["kv_request_id"],
            "remote_host": produced["remote_host"],
            "remote_port": produced["remote_port"],
            "remote_engine_id": produced["remote_engine_id"],
        }
    }


def one_token(prompt: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A greedy one-token completion of ``prompt`` (a leg's latency is then its TTFT)."""
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1}
    body["temperature"] = 0
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def post_completion(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer of ``url``'s ``/v1/completions``; anything but 200 raises."""
    resp = client.post(url + "/v1/completions", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
    answer: dict[str, Any] = resp.json()
    return answer


def timed_completion(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """:func:`post_completion` and how many seconds it took."""
    t0 = time.perf_counter()
    answer = post_completion(client, url, body)
    return time.perf_counter() - t0, answer

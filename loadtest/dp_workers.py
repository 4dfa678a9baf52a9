"""Reference workers with several data-parallel ranks on loopback, as real HTTP servers in the
caller's event loop (for the DP scenario tests and ``bench_dp_ranks``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvtier.worker.ranks import WorkerRanks
from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings
from loadtest.inprocess_server import serving
from pdproxy.stack.ports import free_port_run


@dataclass
class RunningWorker:
    name: str
    url: str
    settings: WorkerSettings
    ranks: WorkerRanks
    p2p_base: int
    events: str
    replay: str

    def backend(self, role: str, dialect: str = "p2p", **extra: Any) -> dict[str, Any]:
        """Its entry in the proxy's ``backends``."""
        entry: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "role": role,
            "dialect": dialect,
            "data_parallel_size": self.settings.data_parallel_size,
            "events_endpoint": self.events,
            "events_replay_endpoint": self.replay,
        }
        if role != "consumer" and dialect == "p2p":
            entry["kv_address"] = f"127.0.0.1:{self.p2p_base}"
        entry.update(extra)
        return entry


@contextlib.asynccontextmanager
async def dp_worker(
    name: str, role: str, data_parallel_size: int, **overrides: Any
) -> AsyncIterator[RunningWorker]:
    """A ``sim`` reference worker with ``data_parallel_size`` ranks, P2P on consecutive ports
    and KV events (and replay) on consecutive ports, one per rank."""
    n = data_parallel_size
    p2p, events, replay = free_port_run(n), free_port_run(n), free_port_run(n)
    values: dict[str, Any] = {
        "model": "sim",
        "role": role,
        "num_pages": 200,
        "host_pages": 400,
        "max_model_len": 4096,
        "p2p_port": p2p,
        "events_endpoint": f"tcp://127.0.0.1:{events}",
        "events_replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "fetch_timeout_s": 5.0,
        "data_parallel_size": n,
        "engine_id": name,
        **overrides,
    }
    settings = WorkerSettings(**values)
    app = create_app(settings)
    async with serving(app) as url:
        yield RunningWorker(
            name, url, settings, app.state.ranks, p2p,
            values["events_endpoint"], values["events_replay_endpoint"],
        )  # fmt: skip

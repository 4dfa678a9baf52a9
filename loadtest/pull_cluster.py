"""An in-process cluster for symmetric pull: reference workers (``both`` role, p2p dialect)
and the proxy (``router: kv``), each a real HTTP server under uvicorn on a loopback port,
all in this event loop. Each backend's ``kv_address``/``kv_engine_id`` are its worker's P2P
server, as an operator would configure them; the KV events reach the router over ZMQ.

Used by the end-to-end pull tests and by :mod:`loadtest.bench_pull`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.residency.types import NodeId
from kvtier.worker.p2p_connector import P2PConnector
from kvtier.worker.server.app import create_app as create_worker_app
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import Worker
from loadtest.inprocess_server import serving
from pdproxy.app import create_app as create_proxy_app
from pdproxy.app import proxy_state
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings import ProxySettings


@dataclass
class Node:
    name: str
    url: str
    worker: Worker

    @property
    def connector(self) -> P2PConnector:
        conn = self.worker.connector
        assert isinstance(conn, P2PConnector)
        return conn

    def counter(self, name: str) -> int:
        """One of the worker's own counters (:class:`kvtier.worker.stats.EngineStats`)."""
        return int(getattr(self.worker.stats, name))


@dataclass
class PullCluster:
    proxy_url: str
    router: KvRouter
    model: str
    nodes: dict[str, Node] = field(default_factory=dict)
    side_url: str | None = None
    """The second proxy replica (``side_proxy``), if any."""

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """A client of the proxy that asks for the route explanation (``x-pdproxy-route``)."""
        return httpx.AsyncClient(
            base_url=self.proxy_url, timeout=120.0, headers={"x-pdproxy-debug": "1"}, **kwargs
        )

    async def holds(self, node: str, prompt_ids: list[int], blocks: int) -> bool:
        """Whether the router's index says ``node`` holds ``blocks`` leading blocks."""
        hashes = self.router.hasher.hash_tokens(prompt_ids)
        m = (await self.router.state.index.match(hashes)).get(NodeId(node))
        return m is not None and m.total >= blocks


def worker_settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {
        "model": "sim",
        "role": "both",
        "num_pages": 512,
        "host_pages": 512,
        "max_model_len": 8192,
        "events_endpoint": "tcp://127.0.0.1:*",
        "events_replay_endpoint": "tcp://127.0.0.1:*",
        "fetch_timeout_s": 5.0,
        **overrides,
    }
    return WorkerSettings(**values)


@contextlib.asynccontextmanager
async def pull_cluster(
    names: tuple[str, ...] = ("a", "b"),
    *,
    roles: Mapping[str, str] | None = None,
    pull: Mapping[str, Any] | None = None,
    worker: Mapping[str, Any] | None = None,
    router: Mapping[str, Any] | None = None,
    proxy: Mapping[str, Any] | None = None,
    side_proxy: tuple[str, ...] = (),
) -> AsyncIterator[PullCluster]:
    """Workers ``names`` (sim unless ``worker`` says otherwise; role ``both`` unless ``roles``
    names another) behind one proxy whose KV router has ``pull`` as its pull settings
    (``{"enabled": True, ...}``). ``side_proxy``: a second proxy replica in front of only
    these backends, sharing the first one's state (``router`` must give an ``index_url``):
    what it sends there counts in the first replica's view of their load."""
    async with contextlib.AsyncExitStack() as stack:
        nodes: dict[str, Node] = {}
        backends: list[dict[str, Any]] = []
        events: dict[str, str] = {}
        replay: dict[str, str] = {}
        for name in names:
            role = (roles or {}).get(name, "both")
            settings = worker_settings(engine_id=f"engine-{name}", role=role, **(worker or {}))
            app = create_worker_app(settings)
            url = await stack.enter_async_context(serving(app))
            node = Node(name, url, app.state.worker)
            nodes[name] = node
            publisher = node.worker.events.publisher
            assert publisher is not None
            events[name], replay[name] = publisher.endpoint, publisher.replay_endpoint or ""
            backend: dict[str, Any] = {"name": name, "url": url, "role": role, "dialect": "p2p"}
            if node.connector.p2p_port:  # a worker with no P2P server can be no holder
                backend["kv_address"] = f"127.0.0.1:{node.connector.p2p_port}"
                backend["kv_engine_id"] = node.connector.engine_id
            backends.append(backend)
        first = next(iter(nodes.values())).worker.settings
        options: dict[str, Any] = {
            "model_seed": first.hash_seed,
            "block_size": first.block_size,
            "events": events,
            "replay": {k: v for k, v in replay.items() if v},
            "pull": dict(pull or {}),
            **(router or {}),
        }
        proxy_settings = ProxySettings.model_validate(
            {
                "backends": backends,
                "router": "kv",
                "router_options": options,
                "health": {"enabled": False},
                "debug_headers": True,
                **(proxy or {}),
            }
        )
        app = create_proxy_app(proxy_settings)
        url = await stack.enter_async_context(serving(app))
        kv_router = proxy_state(app).router
        assert isinstance(kv_router, KvRouter)
        side_url = None
        if side_proxy:
            side = proxy_settings.model_copy(
                update={"backends": [b for b in proxy_settings.backends if b.name in side_proxy]}
            )
            side_url = await stack.enter_async_context(serving(create_proxy_app(side)))
        yield PullCluster(url, kv_router, first.model_name, nodes, side_url)

"""P2P supply release: tell a producer to drop a supply that no consumer will fetch.

Sent (fire and forget, tracked so shutdown can wait for it) by the request's lease
(:mod:`pdproxy.request.lease`): for producer attempts that failed or were abandoned, and at the end
of a request that did not succeed (client gone, every consumer failed, a stream broke). Releases are
idempotent on the worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import orjson

from pdproxy.fleet.backends import Backend
from pdproxy.fleet.dp_ranks import with_rank_header
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.legs import KvRequestId
from pdproxy.request.record import REQUEST_ID_HEADER, LegRequestId
from pdproxy.settings import Dialect
from pdproxy.upstream.client import Upstream

log = logging.getLogger(__name__)

RELEASE_PATH = "/v1/kv/release"


@dataclass(frozen=True, slots=True)
class Supply:
    """A supply a producer may hold for one request."""

    producer: Backend
    kv_request_id: KvRequestId
    dialect: Dialect
    rank: int | None = None
    """The producer's data-parallel rank that holds it (None: not rank-routed)."""


class SupplyReleaser:
    def __init__(self, upstream: Upstream, metrics: ProxyMetrics) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()

    def release(self, supply: Supply, request_id: LegRequestId) -> None:
        """Schedule ``POST /v1/kv/release`` for a P2P supply; other dialects have none."""
        if supply.dialect is not Dialect.P2P:
            return
        task = asyncio.get_running_loop().create_task(self._send(supply, request_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, supply: Supply, request_id: LegRequestId) -> None:
        producer = supply.producer
        headers = {"content-type": "application/json", REQUEST_ID_HEADER: request_id}
        if producer.auth_header is not None:
            headers["authorization"] = producer.auth_header
        with_rank_header(headers, supply.rank)
        body = orjson.dumps({"kv_request_id": supply.kv_request_id})
        try:
            status = await self._upstream.post_json(producer.url + RELEASE_PATH, body, headers)
        except Exception as exc:
            self._metrics.releases.labels(result="error").inc()
            log.warning("request %s: release on %s failed: %r", request_id, producer.name, exc)
            return
        self._metrics.releases.labels(result="ok" if status < 400 else "refused").inc()

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for releases still in flight; used at shutdown."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

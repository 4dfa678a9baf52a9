"""Client connections before their request: a deadline and a budget for those still waiting.

A connection *waits* from the moment it is accepted (and again after each answer, while kept
alive) until it has sent a complete request head. Waiting connections cost a socket and a
protocol object but hold no admission slot, so they do not count against
``admission.max_connections`` (that cap counts requests in progress: with it counting every
open socket, 4,096 silent sockets from one client without a key locked every keyed client out
with 503s for as long as they were held). Instead, a waiting connection is closed

- when it has not completed a head ``head_timeout_s`` after it began waiting (408 when it had
  sent part of one; a kept-alive connection idle that long is closed silently, as uvicorn's
  keep-alive timeout does);
- when ``max_waiting_per_source`` connections from its address are waiting and another one
  arrives: the address's oldest waiting connection is closed (a source flooding sockets evicts
  its own);
- when ``max_waiting_connections`` are waiting in all and another one arrives: the oldest.

A legitimate client sends its head right after connecting, so it is the newest waiting
connection, and leaves the budget before an attacker's churn reaches it.

Behind a load balancer every client's connection comes from the balancer's address: the
per-source cap then caps the balancer's idle pool (set it at or above that pool, or 0 to turn
it off). Unix-socket connections (the sibling channel of ``serve --workers N``) have no source.

Used by :class:`pdproxy.front.protocol.ProxyHttpProtocol`, on the event loop only: every method
runs in a protocol callback (or the gate's own timer) and must not block.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdproxy.settings import AdmissionSettings

CLOSE_REASONS = (
    "head_timeout",
    "head_too_large",
    "waiting_budget",
    "source_budget",
    "max_connections",
)
"""Why the proxy ended a client connection before serving a request on it."""


class Waiting(Protocol):
    """A connection as the gate sees it."""

    def expire(self) -> None:
        """Close the connection now (called at most once per wait, by the gate)."""


class ConnectionGate:
    """The waiting connections of one server, oldest first, and their deadline timer."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.max_in_progress = settings.max_connections
        self.max_head_bytes = settings.max_head_bytes
        self._timeout_s = settings.head_timeout_s
        self._budget = settings.max_waiting_connections
        self._per_source = settings.max_waiting_per_source
        # Insertion order is deadline order (every wait lasts timeout_s); OrderedDict, as its
        # oldest entry is found in O(1) however many were removed before it.
        self._waiting: OrderedDict[Waiting, tuple[float, str | None]] = OrderedDict()
        self._by_source: dict[str, OrderedDict[Waiting, None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The server's loop, taken at the first connection (every call runs on it)."""
        self.closed = Counter[str]()
        """Connections ended per reason (:data:`CLOSE_REASONS`)."""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wait(self, conn: Waiting, source: str | None) -> None:
        """``conn`` waits for a request head (accepted, or kept alive after an answer);
        closes older waiting connections over the budgets first."""
        if not self._per_source:
            source = None  # no per-source budget: nothing to count per address
        if source is not None:
            mine = self._by_source.get(source)
            if mine is not None and len(mine) >= self._per_source:
                self._expire(next(iter(mine)), "source_budget")
        if len(self._waiting) >= self._budget:
            self._expire(next(iter(self._waiting)), "waiting_budget")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        self._waiting[conn] = (deadline, source)
        if source is not None:
            mine = self._by_source.get(source)
            if mine is None:
                mine = self._by_source[source] = OrderedDict()
            mine[conn] = None
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._sweep)

    def done(self, conn: Waiting) -> None:
        """``conn`` has sent a complete head, or closed: it waits no more."""
        entry = self._waiting.pop(conn, None)
        if entry is None or entry[1] is None:
            return
        mine = self._by_source[entry[1]]
        del mine[conn]
        if not mine:
            del self._by_source[entry[1]]

    def refuse(self, conn: Waiting, reason: str) -> None:
        """``conn`` is being closed by its protocol for ``reason`` (counted)."""
        self.done(conn)
        self.closed[reason] += 1

    def _expire(self, conn: Waiting, reason: str) -> None:
        self.refuse(conn, reason)
        conn.expire()

    def _sweep(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None  # the timer was set by wait()
        now = loop.time()
        while self._waiting:
            conn = next(iter(self._waiting))
            deadline = self._waiting[conn][0]
            if deadline > now:
                self._timer = loop.call_at(deadline, self._sweep)
                return
            self._expire(conn, "head_timeout")


class ConnectionMetrics(Collector):
    """``pdproxy_waiting_connections`` and ``pdproxy_connections_closed_total{reason}``."""

    def __init__(self, gate: ConnectionGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily(
            "pdproxy_waiting_connections",
            "Client connections open without a request in progress (waiting for a head)",
        )
        waiting.add_metric([], self._gate.waiting)
        closed = CounterMetricFamily(
            "pdproxy_connections_closed",
            "Client connections the proxy ended before serving a request on them, by reason "
            "(head_timeout, head_too_large, waiting_budget, source_budget: waiting connections "
            "closed; max_connections: answered 503 at the cap of requests in progress)",
            labels=["reason"],
        )
        for reason in CLOSE_REASONS:
            closed.add_metric([reason], self._gate.closed[reason])
        yield from (waiting, closed)

"""Rank-aware routing over any router: each data-parallel rank of a backend is a candidate.

:class:`DpRankRouter` hands the router it wraps one :class:`RankCandidate` per (backend, rank)
(named by :func:`pdproxy.fleet.dp_ranks.rank_node`), so the KV router keeps residency, load and
predictions per rank without knowing ranks exist, and turns the ranked candidates back into
the backends the request path tries: each backend once, at its best rank, with the chosen
rank per backend in ``consumer_ranks``/``producer_ranks`` (the legs' ``X-data-parallel-rank``).
A backend with one rank is handed over as a candidate with the backend's own name: for it the
decision is exactly the wrapped router's.

Load-only routers see the ranks too: round-robin walks (backend, rank) pairs, least-loaded
counts requests per rank (the first-choice consumer and producer of each decision, from route
to finished).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic

from prometheus_client import CollectorRegistry, Counter

from pdproxy.fleet.dp_ranks import rank_node
from pdproxy.routing.base import B, RequestOutcome, Role, RouteDecision, Router, RouteRequest


class RankCandidate(Generic[B]):
    """One rank of a backend as a router sees it (satisfies ``BackendView``)."""

    __slots__ = ("_load", "backend", "name", "rank")

    def __init__(self, backend: B, rank: int | None, load: dict[str, int]) -> None:
        self.backend = backend
        self.rank = rank
        """None: the backend has one rank (no header, the backend's own counts)."""
        self.name = backend.name if rank is None else str(rank_node(backend.name, rank))
        self._load = load

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def role(self) -> Role:
        return self.backend.role

    @property
    def routable(self) -> bool:
        return self.backend.routable

    @property
    def in_flight(self) -> int:
        if self.rank is None:
            return self.backend.in_flight
        return self._load.get(self.name, 0)


def ranks_of(backend: object) -> int:
    """A backend's data-parallel size (1 for views that declare none)."""
    size = getattr(backend, "data_parallel_size", 1)
    return size if isinstance(size, int) and size > 1 else 1


@dataclass(slots=True)
class _Routed:
    inner: RouteDecision[Any]
    outer: RouteDecision[Any]
    charged: tuple[str, ...]


class DpRankMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.routed = Counter(
            "pdproxy_dp_rank_routed",
            "Legs the router placed on a data-parallel rank (first choice), by backend and role",
            ["backend", "rank", "role"],
            registry=r,
        )


class DpRankRouter:
    """Implements :class:`pdproxy.routing.base.Router` around ``inner``."""

    def __init__(self, inner: Router, metrics: DpRankMetrics | None = None) -> None:
        self.inner = inner
        self._metrics = metrics if metrics is not None else DpRankMetrics()
        self._load: dict[str, int] = {}
        self._routed: dict[str, _Routed] = {}

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def _expand(self, backends: Sequence[B]) -> list[RankCandidate[B]]:
        out: list[RankCandidate[B]] = []
        for b in backends:
            n = ranks_of(b)
            if n == 1:
                out.append(RankCandidate(b, None, self._load))
            else:
                out.extend(RankCandidate(b, r, self._load) for r in range(n))
        return out

    async def route(
        self, request: RouteRequest, producers: Sequence[B], consumers: Sequence[B]
    ) -> RouteDecision[B]:
        inner = await self.inner.route(request, self._expand(producers), self._expand(consumers))
        consumers_out, c_ranks = _collapse(inner.consumers)
        producers_out, p_ranks = _collapse(inner.producers)
        explain = dict(inner.explain)
        charged: list[str] = []
        for role, chosen in (("consumer", inner.consumers), ("producer", inner.producers)):
            if chosen and chosen[0].rank is not None:
                first = chosen[0]
                explain[f"{role}_rank"] = first.rank
                charged.append(first.name)
                self._metrics.routed.labels(first.backend.name, str(first.rank), role).inc()
        for node in charged:
            self._load[node] = self._load.get(node, 0) + 1
        outer = RouteDecision(
            request_id=inner.request_id,
            consumers=consumers_out,
            producers=producers_out,
            reason=inner.reason,
            explain=explain,
            predicted_cached_tokens=inner.predicted_cached_tokens,
            predicted_producer_cached_tokens=inner.predicted_producer_cached_tokens,
            prompt_tokens=inner.prompt_tokens,
            route_time_s=inner.route_time_s,
            consumer_ranks=c_ranks,
            producer_ranks=p_ranks,
        )
        stale = self._routed.pop(request.request_id, None)
        if stale is not None:
            self._uncharge(stale.charged)
        self._routed[request.request_id] = _Routed(inner, outer, tuple(charged))
        return outer

    def _uncharge(self, nodes: Sequence[str]) -> None:
        for node in nodes:
            left = self._load.get(node, 0) - 1
            if left > 0:
                self._load[node] = left
            else:
                self._load.pop(node, None)

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        routed = self._routed.get(decision.request_id)
        if routed is None or routed.outer is not decision:
            return
        del self._routed[decision.request_id]
        self._uncharge(routed.charged)
        # The request path names backends; the wrapped router knows rank nodes.
        inner_outcome = replace(
            outcome,
            producer=_node_of(outcome.producer, decision.producer_ranks),
            consumer=_node_of(outcome.consumer, decision.consumer_ranks),
        )
        await self.inner.finished(routed.inner, inner_outcome)


def _node_of(backend: str | None, ranks: Any) -> str | None:
    if backend is None or backend not in ranks:
        return backend
    return str(rank_node(backend, ranks[backend]))


def _collapse(ranked: Sequence[RankCandidate[B]]) -> tuple[list[B], dict[str, int]]:
    """Each backend once, in the order of its best-ranked rank, and that rank."""
    backends: list[B] = []
    ranks: dict[str, int] = {}
    seen: set[str] = set()
    for c in ranked:
        name = c.backend.name
        if name in seen:
            continue
        seen.add(name)
        backends.append(c.backend)
        if c.rank is not None:
            ranks[name] = c.rank
    return backends, ranks

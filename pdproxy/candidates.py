"""Which backends a request may use, decided before the router ranks them.

The router charges load and writes predictions for what it picks, so it must only ever see
candidates the request can actually use: routable consumers, and producers that serve the same
dialect (a ``none``-dialect pool, or a client that brought its own ``kv_transfer_params``, has
no producer leg). When routable consumers speak several dialects, the pool whose consumers have
the fewest requests in flight each serves the request (ties: nixl, p2p, none).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdproxy.backends import Backend, BackendRegistry
from pdproxy.errors import NoBackendAvailable
from pdproxy.settings import Dialect

_DIALECT_ORDER = {Dialect.NIXL: 0, Dialect.P2P: 1, Dialect.NONE: 2}


@dataclass(frozen=True, slots=True)
class Candidates:
    dialect: Dialect
    producers: list[Backend]
    consumers: list[Backend]


def candidates(registry: BackendRegistry, *, with_producers: bool) -> Candidates:
    """Raises :class:`NoBackendAvailable` (503) when no consumer is routable."""
    by_dialect: dict[Dialect, list[Backend]] = {}
    for consumer in registry.consumers():
        by_dialect.setdefault(consumer.dialect, []).append(consumer)
    if not by_dialect:
        raise NoBackendAvailable("no healthy consumer backend")
    if len(by_dialect) == 1:
        [(dialect, consumers)] = by_dialect.items()
    else:
        dialect, consumers = min(
            by_dialect.items(),
            key=lambda kv: (sum(b.in_flight for b in kv[1]) / len(kv[1]), _DIALECT_ORDER[kv[0]]),
        )
    producers: list[Backend] = []
    if with_producers and dialect is not Dialect.NONE:
        producers = [p for p in registry.producers() if p.dialect is dialect]
    return Candidates(dialect, producers, consumers)

"""Which backends a request may use, decided before the router ranks them.

The router charges load and writes predictions for what it picks, so it must only ever see
candidates the request can actually use: routable consumers that serve the request's model,
and producers that serve the same model and dialect (a ``none``-dialect pool, or a client that
brought its own ``kv_transfer_params``, has no producer leg). When routable consumers speak
several dialects, the pool whose consumers have the fewest requests in flight each serves the
request (ties: nixl, p2p, none).

A LoRA adapter goes to backends that have it loaded; only when none is routable, and the
adapter is marked ``load_on_demand``, to backends serving its base model (an engine with a LoRA
resolver loads it on first use). A known model with no routable backend is a 503.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdproxy.errors import NoBackendAvailable
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.models import ModelRef
from pdproxy.settings import Dialect

_DIALECT_ORDER = {Dialect.NIXL: 0, Dialect.P2P: 1, Dialect.NONE: 2}


@dataclass(frozen=True, slots=True)
class Candidates:
    dialect: Dialect
    producers: list[Backend]
    consumers: list[Backend]


def _serving(backends: list[Backend], model: ModelRef | None) -> list[Backend]:
    if model is None:
        return backends
    loaded = [b for b in backends if b.serves_model(model.name)]
    if loaded or not model.load_on_demand or model.base is None:
        return loaded
    base = model.base
    return [b for b in backends if b.serves_model(base)]


def candidates(
    registry: BackendRegistry, *, with_producers: bool, model: ModelRef | None = None
) -> Candidates:
    """Raises :class:`NoBackendAvailable` (503) when no consumer serving ``model`` is
    routable."""
    by_dialect: dict[Dialect, list[Backend]] = {}
    for consumer in _serving(registry.consumers(), model):
        by_dialect.setdefault(consumer.dialect, []).append(consumer)
    if not by_dialect:
        what = f" for model {model.label!r}" if model is not None else ""
        raise NoBackendAvailable(f"no healthy consumer backend{what}")
    if len(by_dialect) == 1:
        [(dialect, consumers)] = by_dialect.items()
    else:
        dialect, consumers = min(
            by_dialect.items(),
            key=lambda kv: (sum(b.in_flight for b in kv[1]) / len(kv[1]), _DIALECT_ORDER[kv[0]]),
        )
    producers: list[Backend] = []
    if with_producers and dialect is not Dialect.NONE:
        producers = [p for p in _serving(registry.producers(), model) if p.dialect is dialect]
    return Candidates(dialect, producers, consumers)

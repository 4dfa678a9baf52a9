"""Which backends a request may use, decided before the router ranks them: the filter chain.

The router charges load and writes predictions for what it picks, so it must only ever see
candidates the request can actually use. Each filter narrows a list of backends, keeping
their order; :func:`candidates` chains them once per request, in this order:

1. :func:`acting_as`: the role (a ``both`` backend is a producer and a consumer; a
   ``none``-dialect backend is never a producer: it has no producer leg);
2. :func:`routable`: healthy, breaker not open, not draining;
3. :func:`serving`: the request's model. A LoRA adapter goes to backends that have it loaded;
   only when none is routable, and the adapter is marked ``load_on_demand``, to backends
   serving its base model (an engine with a LoRA resolver loads it on first use);
4. the dialect: when routable consumers speak several dialects, the pool whose consumers have
   the fewest requests in flight each serves the request (ties: nixl, p2p, none), and
   :func:`speaking` keeps the producers of that dialect (a ``none`` pool, or a client that
   brought its own ``kv_transfer_params``, has no producer leg).

A data-parallel backend's ranks are not filtered here: the rank-aware router
(:mod:`pdproxy.routing.dp_router`) expands each backend the chain kept into its ranks. A known
model with no routable backend is a 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdproxy.errors import NoBackendAvailable
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.models import ModelRef
from pdproxy.settings import Dialect, Role

_DIALECT_ORDER = {Dialect.NIXL: 0, Dialect.P2P: 1, Dialect.NONE: 2}


@dataclass(frozen=True, slots=True)
class Candidates:
    dialect: Dialect
    producers: list[Backend]
    consumers: list[Backend]


def acting_as(backends: Sequence[Backend], role: Role) -> list[Backend]:
    if role is Role.PRODUCER:
        return [b for b in backends if b.serves(role) and b.dialect is not Dialect.NONE]
    return [b for b in backends if b.serves(role)]


def routable(backends: Sequence[Backend]) -> list[Backend]:
    return [b for b in backends if b.routable]


def serving(backends: list[Backend], model: ModelRef | None) -> list[Backend]:
    if model is None:
        return backends
    loaded = [b for b in backends if b.serves_model(model.name)]
    if loaded or not model.load_on_demand or model.base is None:
        return loaded
    base = model.base
    return [b for b in backends if b.serves_model(base)]


def speaking(backends: Sequence[Backend], dialect: Dialect) -> list[Backend]:
    return [b for b in backends if b.dialect is dialect]


def candidates(
    registry: BackendRegistry, *, with_producers: bool, model: ModelRef | None = None
) -> Candidates:
    """The chain over the registry's backends. Raises :class:`NoBackendAvailable` (503) when
    no consumer serving ``model`` is routable."""
    backends = registry.all()
    by_dialect: dict[Dialect, list[Backend]] = {}
    for consumer in serving(routable(acting_as(backends, Role.CONSUMER)), model):
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
        producers = speaking(serving(routable(acting_as(backends, Role.PRODUCER)), model), dialect)
    return Candidates(dialect, producers, consumers)

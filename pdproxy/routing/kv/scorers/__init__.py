"""The KV router's signals, one module each, and the registry that names them.

Rule 1: a scorer's hooks never await or do I/O; a view's methods are pure (the interface, who
calls it and when: :mod:`~pdproxy.routing.kv.scorers.base`).
Rule 2: adding a signal is a module here (its state, view and ``build``) plus one line in
:data:`SCORERS`; its settings are a class and a field in :mod:`pdproxy.settings.scorers` and
:class:`~pdproxy.settings.routing.KvRouterSettings` (the settings layer cannot import this one).

The order of :data:`SCORERS` is the order every hook runs in: the cost terms are summed in it
(``load`` then ``engine_load`` then ``prefix``: floating-point sums depend on their order, and
this one is the order the cost has always been added in) and the explanation's rows gain their
fields in it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from pdproxy.routing.kv.scorers import (
    affinity,
    engine_load,
    index_exactness,
    load,
    prefix,
    pull,
    ttft,
)
from pdproxy.routing.kv.scorers.base import Scorer, ScorerFactory
from pdproxy.settings.routing import KvRouterSettings

SCORERS: dict[str, ScorerFactory] = {
    "affinity": affinity.build,  # the session's last node believed to hold its prefix
    "index_exactness": index_exactness.build,  # a node's match discounted while events lag
    "load": load.build,  # requests and prefill tokens routed and not finished
    "engine_load": engine_load.build,  # what the engine reports beyond our own requests
    "prefix": prefix.build,  # cached blocks credited by tier; P2P fetch for a PD consumer
    "ttft": ttft.build,  # predicted TTFT: re-ranks, bypasses the producer, sheds (warm pools)
    "pull": pull.build,  # a free node pulls the prefix from its busy holder
}


def build_scorers(
    settings: KvRouterSettings, registry: CollectorRegistry
) -> tuple[Scorer[Any], ...]:
    """One of each registered scorer for one router, their metrics on ``registry``."""
    return tuple(factory(settings, registry) for factory in SCORERS.values())


__all__ = ["SCORERS", "Scorer", "build_scorers"]

"""Routing: choose the producer and consumer backends for a request.

Rule 1: a decision is pure: it reads a snapshot of state (residency, load, predictions, each
signal's view) and the candidates, and returns a :class:`~pdproxy.routing.base.RouteDecision`;
the I/O that feeds the state (KV events, engine metrics, Redis) runs beside it, never inside it.
Rule 2: filter first, then rank: the request path narrows the candidates once, with the filter
chain of :mod:`~pdproxy.routing.candidates` (role, routable, model and adapter, dialect); a
router only ranks what it is given.

In the shape of llm-d's scheduler, filters → scorers → picker:

- :mod:`~pdproxy.routing.base`: the contract with the request path;
  :mod:`~pdproxy.routing.candidates`: the filters;
- :mod:`~pdproxy.routing.simple`: round-robin and least-loaded;
- :mod:`~pdproxy.routing.kv`: the KV-aware router, one decision read as observe → filter →
  score → pick → record (:mod:`~pdproxy.routing.kv.router`); its signals are scorers, one
  module each, named in one registry (:mod:`~pdproxy.routing.kv.scorers`), and the picker is
  :mod:`~pdproxy.routing.kv.decide`;
- :mod:`~pdproxy.routing.dp_router` (a candidate per data-parallel rank),
  :mod:`~pdproxy.routing.per_model` (a KV router per model), :mod:`~pdproxy.routing.factory`
  (which router the settings name).

Where the settings live, a choice: the router's options, its scorers' sections included, are
typed in the settings tree (:mod:`pdproxy.settings.routing`, :mod:`pdproxy.settings.scorers`),
not in the scorer modules. ``router_options`` must be validated when the config is loaded,
with errors naming the key path, and the settings layer imports no runtime module and sits
below routing (``tests/pdproxy/test_layout.py``): a scorer module imports prometheus and the
router's state, so the settings could not import its class. A scorer module holds everything
else of its signal: its state, its view (the score functions), its factory.
"""

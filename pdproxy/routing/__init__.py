"""Routing: choose the producer and consumer backends for a request.

Rule 1: a decision is pure: it reads a snapshot of state (residency, load, predictions) and the
candidates, and returns a :class:`~pdproxy.routing.base.RouteDecision`; the I/O that feeds the
state (KV events, engine metrics, Redis) runs beside it, never inside it.
Rule 2: filter first, then rank: a router only ever sees candidates the request can use.
"""

"""Load per backend as the router sees it: requests in flight and prefill tokens queued.

The router charges a decision's nodes when it routes and releases them when the request is
over. :class:`MemoryLoad` keeps the figures for this process; the Redis tracker
(:mod:`pdproxy.routing.kv.shared_load`) shares them across proxy replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeLoad:
    in_flight: int = 0
    queued_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LoadDelta:
    """A change to one node's load (negative when a request is over)."""

    node: str
    in_flight: int
    queued_tokens: int

    def negated(self) -> LoadDelta:
        return LoadDelta(self.node, -self.in_flight, -self.queued_tokens)


class MemoryLoad:
    """This process's view; synchronous underneath (the async methods never wait)."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def get(self, node: str) -> NodeLoad:
        return NodeLoad(max(self._in_flight.get(node, 0), 0), max(self._tokens.get(node, 0), 0))

    def apply(self, deltas: Iterable[LoadDelta]) -> None:
        for d in deltas:
            self._in_flight[d.node] = self._in_flight.get(d.node, 0) + d.in_flight
            self._tokens[d.node] = self._tokens.get(d.node, 0) + d.queued_tokens

    def snapshot(self) -> dict[str, NodeLoad]:
        return {node: self.get(node) for node in self._in_flight}

    async def read(self, nodes: Sequence[str]) -> dict[str, NodeLoad]:
        return {n: self.get(n) for n in nodes}

    async def add(self, deltas: Sequence[LoadDelta]) -> None:
        self.apply(deltas)

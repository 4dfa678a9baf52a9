"""What the KV router decides over: one :class:`RouterState` (residency index, load,
predictions and, when shared, the store guard), in this process or shared through Redis.

The router makes one decision over one state and never asks which kind it has:

- :meth:`RouterState.observe` returns matches and loads for a decision (matches ``None`` when
  the index could not be asked: the decision goes on by load alone);
- :meth:`RouterState.record` charges the chosen nodes and writes predictions
  (:func:`charges`);
- :meth:`RouterState.release` undoes a charge when the request is over.

:class:`LocalState` (this module) keeps everything in process, its load in a
:class:`MemoryLoad`; :class:`pdproxy.routing.kv.shared_state.SharedState` keeps it in Redis
(load: :mod:`pdproxy.routing.kv.shared_load`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from kvtier.keys import BlockHash
from kvtier.residency.types import Match, NodeId, ResidencyIndex
from pdproxy.fleet.backends import BreakerState
from pdproxy.routing.kv.plan import NO_MATCH, Plan, held_blocks

if TYPE_CHECKING:
    from pdproxy.routing.kv.stream_leases import StreamLeases


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """A node's load as the router sees it: requests in flight and prefill tokens queued."""

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
    """This process's view of load; synchronous underneath (the async methods never wait)."""

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


def as_nodes(names: Sequence[str]) -> Sequence[NodeId]:
    """Backend names as index node ids (the same strings; no copy)."""
    return cast("Sequence[NodeId]", names)


@dataclass(frozen=True, slots=True)
class Observation:
    """What a decision sees. ``source``: ``memory``, ``redis`` or ``fallback`` (the shared
    store failed: load is this replica's own, matches are None)."""

    matches: dict[NodeId, Match] | None
    loads: dict[str, NodeLoad]
    source: str


@dataclass(frozen=True, slots=True)
class Prediction:
    """``node`` is expected to hold ``hashes`` soon (the router just sent it the prompt)."""

    node: NodeId
    hashes: Sequence[BlockHash]


def charges(
    plan: Plan, tokens: int, matches: Mapping[NodeId, Match], block_size: int
) -> tuple[LoadDelta, ...]:
    """What a decision charges: the chosen consumer one request in flight, and the node that
    prefills (the producer, or the consumer alone) the prompt's ``tokens`` it does not hold;
    a pull's target only what it computes past the holder's prefix."""

    def uncached(node: str) -> int:
        held = held_blocks(matches.get(NodeId(node), NO_MATCH))
        return max(tokens - held * block_size, 0)

    consumer = plan.consumers[0]
    if not plan.producers:
        deltas: tuple[LoadDelta, ...] = (LoadDelta(consumer, 1, uncached(consumer)),)
    else:
        producer = plan.producers[0]
        deltas = (LoadDelta(consumer, 1, 0), LoadDelta(producer, 1, uncached(producer)))
    pull = plan.pull
    if pull is None:
        return deltas
    rest = max(tokens - pull.holder_blocks * block_size, 0)
    return tuple(
        LoadDelta(d.node, d.in_flight, min(d.queued_tokens, rest)) if d.node == pull.target else d
        for d in deltas
    )


def predictions(
    plan: Plan, hashes: Sequence[BlockHash], matches: Mapping[NodeId, Match]
) -> list[Prediction]:
    """The chosen nodes are predicted to hold the prompt's blocks past those they are known to
    hold (by events, or by a live prediction: siblings of a burst do not rewrite the same
    entries), so siblings arriving before the KV events follow the first request."""
    out: list[Prediction] = []
    for name in (plan.consumers[0], *plan.producers[:1]):
        node = NodeId(name)
        known = held_blocks(matches.get(node, NO_MATCH))
        if known < len(hashes):
            out.append(Prediction(node, hashes[known:]))
    return out


class RouterState(Protocol):
    @property
    def index(self) -> ResidencyIndex:
        """The residency index (event feeds apply to it)."""
        ...

    @property
    def local(self) -> MemoryLoad:
        """This process's own load (what a fallback decision sees)."""
        ...

    @property
    def shared(self) -> bool:
        """Whether other replicas share this state (event feeds keep a late joiner's state)."""
        ...

    @property
    def breaker_state(self) -> BreakerState: ...

    @property
    def leases(self) -> StreamLeases | None:
        """Which worker event streams this replica writes (shared state); None: all of them."""
        ...

    async def start(self) -> None: ...

    async def observe(
        self, hashes: Sequence[BlockHash] | None, names: Sequence[str]
    ) -> Observation:
        """Matches of ``hashes`` (None: no prompt) and the loads of ``names``."""
        ...

    async def record(
        self, deltas: Sequence[LoadDelta], predictions: Sequence[Prediction], ttl_s: float
    ) -> bool:
        """Charge ``deltas`` and write ``predictions``; True when the charge reached a store
        that :meth:`release` must also reach."""
        ...

    async def release(self, deltas: Sequence[LoadDelta], recorded: bool) -> None:
        """Undo a charge (``deltas`` already negated); ``recorded`` is what record returned."""
        ...

    async def close(self) -> None: ...


class LocalState:
    """:class:`RouterState` in this process: a :class:`MemoryIndex`-like index, load here."""

    shared = False

    def __init__(self, index: ResidencyIndex) -> None:
        self._index = index
        self._local = MemoryLoad()

    @property
    def index(self) -> ResidencyIndex:
        return self._index

    @property
    def local(self) -> MemoryLoad:
        return self._local

    @property
    def breaker_state(self) -> BreakerState:
        return BreakerState.CLOSED

    @property
    def leases(self) -> StreamLeases | None:
        return None

    async def start(self) -> None:
        return None

    async def observe(
        self, hashes: Sequence[BlockHash] | None, names: Sequence[str]
    ) -> Observation:
        loads = {n: self._local.get(n) for n in names}
        matches = None if hashes is None else await self._index.match(hashes, as_nodes(names))
        return Observation(matches, loads, "memory")

    async def record(
        self, deltas: Sequence[LoadDelta], predictions: Sequence[Prediction], ttl_s: float
    ) -> bool:
        self._local.apply(deltas)
        for p in predictions:
            await self._index.predict(p.node, p.hashes, ttl_s)
        return False

    async def release(self, deltas: Sequence[LoadDelta], recorded: bool) -> None:
        self._local.apply(deltas)

    async def close(self) -> None:
        await self._index.close()

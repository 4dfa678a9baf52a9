"""What the KV router decides over: one :class:`RouterState` (residency index, load,
predictions and, when shared, the store guard), in this process or shared through Redis.

The router makes one decision over one state and never asks which kind it has:

- :meth:`RouterState.observe` returns matches and loads for a decision (matches ``None`` when
  the index could not be asked: the decision goes on by load alone);
- :meth:`RouterState.record` charges the chosen nodes and writes predictions;
- :meth:`RouterState.release` undoes a charge when the request is over.

:class:`LocalState` (this module) keeps everything in process;
:class:`pdproxy.routing.kv.shared_state.SharedState` keeps it in Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from kvtier.keys import BlockHash
from kvtier.residency.types import Match, NodeId, ResidencyIndex
from pdproxy.fleet.backends import BreakerState
from pdproxy.routing.kv.load import LoadDelta, MemoryLoad, NodeLoad

if TYPE_CHECKING:
    from pdproxy.routing.kv.stream_leases import StreamLeases


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

"""The residency index contract: where each block lives, per node and per tier.

Shared by the in-memory index (embedded default) and the Redis index (several proxies sharing
state). Both implementations pass one contract test suite.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from kvtier.keys import BlockHash

NodeId = NewType("NodeId", str)
"""A worker as the router knows it (its configured backend name)."""


@dataclass(frozen=True, slots=True)
class Match:
    """How much of a prompt's block chain one node holds, as contiguous prefix lengths.

    ``gpu``: leading blocks resident on the node's GPU. ``cpu``: leading blocks resident in its
    host (CPU) tier. ``total``: leading blocks resident in either tier (≥ max(gpu, cpu)).
    ``predicted``: leading blocks resident or predicted (speculative entries written when a
    request was routed there and not yet confirmed by events), ≥ ``total``.
    """

    gpu: int = 0
    cpu: int = 0
    total: int = 0
    predicted: int = 0


class ResidencyIndex(Protocol):
    """Block residency per node and tier, fed by KV events.

    Calls are async because the shared implementation is remote. Implementations raise
    ``kvtier.errors.ResidencyUnavailable`` (bounded by a short deadline) when their store fails,
    so a router can fall back to load-only routing.
    """

    async def apply(self, node: NodeId, batch: object) -> None:
        """Apply one ``kvtier.events.EventBatch`` published by ``node``.

        Engine block hashes are translated to router hashes from the events' token ids
        (``kvtier.residency.translate``); ``AllBlocksCleared`` drops the node's residency and
        predictions.
        """
        ...

    async def match(
        self, hashes: Sequence[BlockHash], among: Collection[NodeId] | None = None
    ) -> dict[NodeId, Match]:
        """Per node with a non-empty match, the contiguous prefix it holds of ``hashes``.

        ``among``: only these nodes (a decision's candidates; None: every node). Filtering
        first lets the walk stop as soon as no candidate holds a block, so its cost follows
        the candidates, not the nodes the index knows.
        """
        ...

    async def predict(self, node: NodeId, hashes: Sequence[BlockHash], ttl_s: float) -> None:
        """Speculative residency for ``hashes`` on ``node`` that expires after ``ttl_s``."""
        ...

    async def forget(self, node: NodeId) -> None:
        """Drop everything known about ``node`` (it restarted, was removed, or lost events)."""
        ...

    async def nodes(self) -> list[NodeId]:
        """Nodes the index knows: those with events applied or predictions made since they
        were last forgotten (a node whose engine cleared its cache stays known, holding
        nothing)."""
        ...

    async def close(self) -> None:
        """Release connections; the index is unusable afterwards."""
        ...

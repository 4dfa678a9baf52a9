"""Data-parallel ranks: one HTTP endpoint, several engines (ranks), each with its own KV cache.

The router's node is the pair (backend, rank), named by :func:`rank_node`: rank 0 is the
backend's own name, so a ``data_parallel_size: 1`` backend is exactly the node it always was
(same residency keys in memory and in Redis, same load counters) and a backend that grows to
several ranks keeps rank 0's state. Rank ``r`` > 0 is ``<backend>#dp<r>``: ``#`` never occurs
in a backend name, so no rank node can collide with another backend.

Per rank, as vLLM lays a DP deployment out:

- legs carry ``X-data-parallel-rank: r`` (vLLM's API server sends the request to that rank);
- rank ``r`` publishes KV events on the events endpoint's port + ``r`` (and its replay socket
  on the replay port + ``r``): ``ZmqEventPublisher.offset_endpoint_port``;
- a producer's rank ``r`` serves P2P on ``kv_address``'s port + ``r`` (vLLM's P2P proxy:
  ``remote_port = base + dp_rank``), so the answer of rank ``r`` must name that port.

Event batches carry ``data_parallel_rank``. A rank's stream is identified by its socket; the
tag is a cross-check: a batch tagged with another rank (out of range, or another rank's) is
refused and counted (:func:`batch_rank_refused`), never applied to any rank. An untagged batch
(engines before the field, kvtier's DP=1 worker) belongs to the socket's rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.events.ranks import offset_endpoint
from kvtier.events.types import EventBatch
from kvtier.residency.types import NodeId

DP_RANK_HEADER = "x-data-parallel-rank"
"""vLLM's request header naming the DP rank that serves a request."""

_SEPARATOR = "#dp"


def rank_node(backend: str, rank: int) -> NodeId:
    """The router's node for ``rank`` of ``backend`` (rank 0: the backend's own name)."""
    if rank < 0:
        raise ValueError(f"data-parallel rank {rank} is negative")
    return NodeId(backend if rank == 0 else f"{backend}{_SEPARATOR}{rank}")


def node_rank(node: str) -> tuple[str, int]:
    """(backend, rank) of a node named by :func:`rank_node` (any other name: rank 0)."""
    backend, sep, digits = node.rpartition(_SEPARATOR)
    if sep and backend and digits.isascii() and digits.isdigit() and digits[0] != "0":
        return backend, int(digits)
    return node, 0


def offset_port(address: tuple[str, int] | None, rank: int | None) -> tuple[str, int] | None:
    """``host:port`` of rank ``rank`` (vLLM's P2P convention: port + rank)."""
    if address is None or not rank:
        return address
    return address[0], address[1] + rank


def rank_streams(
    name: str,
    size: int,
    events_endpoint: str | None,
    replay_endpoint: str | None,
) -> list[tuple[NodeId, str | None, str | None]]:
    """(node, events endpoint, replay endpoint) of each rank of a backend."""
    return [
        (
            rank_node(name, r),
            offset_endpoint(events_endpoint, r),
            offset_endpoint(replay_endpoint, r),
        )
        for r in range(size)
    ]


def batch_rank_refused(node: str, batch: EventBatch) -> bool:
    """True when ``batch``, received on ``node``'s stream, is tagged with another rank."""
    tagged = batch.data_parallel_rank
    return tagged is not None and tagged != node_rank(node)[1]


def with_rank_header(headers: dict[str, str], rank: int | None) -> dict[str, str]:
    """``headers`` plus ``X-data-parallel-rank`` when a rank was chosen."""
    if rank is not None:
        headers[DP_RANK_HEADER] = str(rank)
    return headers


def chosen_rank(ranks: Mapping[str, int] | None, backend: str) -> int | None:
    """The rank a decision chose on ``backend`` (None: not rank-routed)."""
    return None if ranks is None else ranks.get(backend)

"""Where KV blocks live, per node and tier: the index contract and its two implementations.

:class:`MemoryIndex` (in process, the default) and :class:`RedisIndex` (shared through Redis)
both implement :class:`ResidencyIndex`. Import ``RedisIndex`` from
:mod:`kvtier.residency.redis_index`; it is not imported here so the in-process path does not
load the Redis client.
"""

from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import Match, NodeId, ResidencyIndex

__all__ = ["Match", "MemoryIndex", "NodeId", "ResidencyIndex"]

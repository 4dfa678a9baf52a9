"""KV cache events in vLLM's wire format: types, msgpack codec, ZMQ publisher and subscriber.

The names below load on first use (PEP 562), so that importing a pure part of the package
(``kvtier.events.ranks``, ``kvtier.events.types``) does not load ZMQ: the proxy's settings
validate DP-rank endpoints with :func:`kvtier.events.ranks.offset_endpoint` and must not import
the runtime to do so.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.events.codec import EventEncoding, decode_batch, encode_batch
    from kvtier.events.publisher import EventPublisher
    from kvtier.events.subscriber import EventSubscriber, SubscriberStats
    from kvtier.events.types import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EngineBlockHash,
        EventBatch,
        KVEvent,
        Medium,
        event_medium,
    )

_HOME = {
    "EventEncoding": "codec",
    "decode_batch": "codec",
    "encode_batch": "codec",
    "EventPublisher": "publisher",
    "EventSubscriber": "subscriber",
    "SubscriberStats": "subscriber",
    "AllBlocksCleared": "types",
    "BlockRemoved": "types",
    "BlockStored": "types",
    "EngineBlockHash": "types",
    "EventBatch": "types",
    "KVEvent": "types",
    "Medium": "types",
    "event_medium": "types",
}

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockHash",
    "EventBatch",
    "EventEncoding",
    "EventPublisher",
    "EventSubscriber",
    "KVEvent",
    "Medium",
    "SubscriberStats",
    "decode_batch",
    "encode_batch",
    "event_medium",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)

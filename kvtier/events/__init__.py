"""KV cache events in vLLM's wire format: types, msgpack codec, ZMQ publisher and subscriber."""

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

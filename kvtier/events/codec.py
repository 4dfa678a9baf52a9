"""msgpack encoding of :class:`EventBatch` exactly as vLLM's msgspec structs produce it.

vLLM declares its events as msgspec structs with ``tag=True`` and ``omit_defaults=True``;
the batch is an array-like struct, ``[ts, events, data_parallel_rank]`` (msgspec writes every
field of an array-like struct, defaults included; engines older than the rank send two).
Two generations of the event encoding exist, and :func:`decode_batch` reads both:

- ``ARRAY`` (``array_like=True``, vLLM up to 0.23): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``, every field written;
  older engines end after ``lora_id`` or ``medium`` (decoders ignore surplus trailing fields).
- ``MAP`` (vLLM PR 42892 and later): ``{"type": "BlockStored", "block_hashes": ..., ...}``,
  optional fields left off when they hold their default (``None``).

:func:`encode_batch` writes either; ``ARRAY`` is the default because every consumer of vLLM
events, old and new, reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import msgpack

from kvtier.errors import EventDecodeError
from kvtier.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
    KVEvent,
)


class EventEncoding(Enum):
    """How events inside a batch are laid out (the batch itself is always an array)."""

    ARRAY = "array"
    MAP = "map"


# Field order per tag and how many leading fields have no default (always encoded).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_STORED_REQUIRED = 7
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REMOVED_REQUIRED = 2
# Positional decoding: the fewest fields an engine of any generation sends.
_STORED_MIN = 5
_REMOVED_MIN = 1


def _event_values(event: KVEvent) -> tuple[str, tuple[str, ...], int, list[Any]]:
    if isinstance(event, BlockStored):
        values: list[Any] = [
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            None if event.extra_keys is None else list(event.extra_keys),
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
        ]
        return "BlockStored", _STORED_FIELDS, _STORED_REQUIRED, values
    if isinstance(event, BlockRemoved):
        values = [list(event.block_hashes), event.medium, event.group_idx]
        return "BlockRemoved", _REMOVED_FIELDS, _REMOVED_REQUIRED, values
    return "AllBlocksCleared", (), 0, []


def _encode_event(event: KVEvent, encoding: EventEncoding) -> object:
    tag, names, required, values = _event_values(event)
    if encoding is EventEncoding.MAP:
        out: dict[str, object] = {"type": tag}
        for i, (name, value) in enumerate(zip(names, values, strict=True)):
            if i < required or value is not None:
                out[name] = value
        return out
    return [tag, *values]


def encode_batch(batch: EventBatch, encoding: EventEncoding = EventEncoding.ARRAY) -> bytes:
    """The msgpack payload vLLM would publish for ``batch``."""
    body = [batch.ts, [_encode_event(e, encoding) for e in batch.events], batch.data_parallel_rank]
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def _hashes(value: object, what: str) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{what}: expected a list of block hashes")
    for h in value:
        if isinstance(h, bool) or not isinstance(h, int | bytes):
            raise EventDecodeError(f"{what}: block hash must be int or bytes, got {type(h)}")
    return tuple(value)


def _opt_hash(value: object) -> EngineBlockHash | None:
    if value is None or (isinstance(value, int | bytes) and not isinstance(value, bool)):
        return value
    raise EventDecodeError("parent_block_hash must be int, bytes or nil")


def _opt_int(value: object, what: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise EventDecodeError(f"{what} must be an int or nil")


def _opt_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise EventDecodeError(f"{what} must be a string or nil")


def _stored(f: dict[str, object]) -> BlockStored:
    tokens = f.get("token_ids")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise EventDecodeError("token_ids must be a list of non-negative ints")
    block_size = f.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise EventDecodeError("block_size must be a positive int")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise EventDecodeError("extra_keys must be a list or nil")
    return BlockStored(
        block_hashes=_hashes(f.get("block_hashes"), "BlockStored.block_hashes"),
        parent_block_hash=_opt_hash(f.get("parent_block_hash")),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=None if extra is None else tuple(extra),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
    )


def _removed(f: dict[str, object]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f.get("block_hashes"), "BlockRemoved.block_hashes"),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _cleared(_f: dict[str, object]) -> AllBlocksCleared:
    return AllBlocksCleared()


_DECODERS: dict[str, tuple[Sequence[str], int, Callable[[dict[str, object]], KVEvent]]] = {
    "BlockStored": (_STORED_FIELDS, _STORED_MIN, _stored),
    "BlockRemoved": (_REMOVED_FIELDS, _REMOVED_MIN, _removed),
    "AllBlocksCleared": ((), 0, _cleared),
}


def _decode_event(raw: object) -> KVEvent | None:
    """One event in either encoding; ``None`` for a tag this version does not know."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise EventDecodeError("array-encoded event must start with its tag")
        spec = _DECODERS.get(raw[0])
        if spec is None:
            return None
        names, minimum, build = spec
        values = raw[1:]
        if len(values) < minimum:
            raise EventDecodeError(f"{raw[0]}: {len(values)} fields, need at least {minimum}")
        return build(dict(zip(names, values, strict=False)))
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise EventDecodeError("map-encoded event needs a string 'type'")
        spec = _DECODERS.get(tag)
        if spec is None:
            return None
        names, _, build = spec
        if names and "block_hashes" not in raw:
            raise EventDecodeError(f"{tag}: missing block_hashes")
        return build(raw)
    raise EventDecodeError(f"an event must be an array or a map, got {type(raw).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one published payload; raises :class:`EventDecodeError` for anything malformed.

    Events with a tag this version does not know are skipped (newer engines may add some).
    """
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, dict):  # tolerate a map-encoded batch as well
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("an EventBatch is [ts, events, data_parallel_rank?]")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise EventDecodeError("EventBatch.ts must be a number")
    if not isinstance(events, list):
        raise EventDecodeError("EventBatch.events must be a list")
    rank = _opt_int(raw[2] if len(raw) > 2 else None, "data_parallel_rank")
    decoded = tuple(e for e in map(_decode_event, events) if e is not None)
    return EventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank)

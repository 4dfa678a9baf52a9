"""Key names and value encodings of the Redis residency index (one model per hash tag).

Every key of a model starts with its tag ``{namespace:model}``, so Redis Cluster keeps the
model in one slot and its scripts may touch any of them; each script names every key it
touches in ``KEYS``.

=========================  ======  ===========================================================
key                        type    value
=========================  ======  ===========================================================
``{t}:slots``              hash    node → slot (a small integer the node owns while it lives)
``{t}:names``              hash    slot → node (match resolves only slots that name a node)
``{t}:nodes``              set     known nodes
``{t}:retired``            set     slots of forgotten/cleared nodes awaiting a sweep
``{t}:free``               set     swept slots, handed out again before new ones
``{t}:next``               string  slots ever handed out (the next new slot)
``{t}:plive``              string  exists while any prediction may (TTL of the longest one)
``{t}:r:<h>``              string  residency of block ``h``: 3-byte entries sorted by slot:
                                   slot (2 bytes, big-endian), tiers (1 GPU, 2 CPU)
``{t}:p:<h>``              string  predictions of ``h``: 16-byte entries: slot (2 bytes), expiry
                                   (14 ASCII digits, ms on the Redis clock)
``{t}:emap:<node>``        hash    the node's engine-hash map: engine hash (``i<int>`` or
                                   ``b<bytes>``) → media mask (1 byte) + its router hashes, so
                                   whichever replica writes the node's events next resolves
                                   removals of blocks stored before it took over
``{t}:seq:<node>``         string  sequence number of the node's last applied event batch
``{t}:lease:<node>``       string  the replica that writes the node's events (with a TTL)
=========================  ======  ===========================================================

A value's cost to read is its number of holders, never the number of nodes of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.events.types import EngineBlockHash
from kvtier.keys import BLOCK_HASH_BYTES, BlockHash
from kvtier.residency.redis_client import hash_tag

MAX_SLOTS = 1 << 16
"""Slots per model (two bytes per entry): live and retired nodes together."""

TIER_GPU, TIER_CPU = 1, 2
RESIDENCY_ENTRY = 3
PREDICTION_ENTRY = 16


@dataclass(frozen=True, slots=True)
class ModelKeys:
    """The keys of one model under ``namespace``."""

    tag: str
    slots: bytes
    names: bytes
    nodes: bytes
    retired: bytes
    free: bytes
    next: bytes
    plive: bytes
    r: bytes
    """Prefix of residency keys (``r + h``)."""
    p: bytes
    """Prefix of prediction keys (``p + h``)."""

    @classmethod
    def of(cls, namespace: str, model_seed: str) -> ModelKeys:
        tag = hash_tag(namespace, model_seed)
        t = tag.encode()
        return cls(
            tag,
            t + b":slots",
            t + b":names",
            t + b":nodes",
            t + b":retired",
            t + b":free",
            t + b":next",
            t + b":plive",
            t + b":r:",
            t + b":p:",
        )

    @property
    def meta(self) -> list[bytes]:
        """``KEYS[1..6]`` of apply.lua and predict.lua."""
        return [self.slots, self.names, self.nodes, self.retired, self.free, self.next]

    def emap(self, node: str) -> bytes:
        return f"{self.tag}:emap:{node}".encode()

    def seq(self, node: str) -> bytes:
        return f"{self.tag}:seq:{node}".encode()

    def lease(self, node: str) -> bytes:
        return f"{self.tag}:lease:{node}".encode()


def engine_field(h: EngineBlockHash) -> bytes:
    """An engine hash as a field of the engine-hash map (ints and bytes never collide)."""
    return b"b" + h if isinstance(h, bytes) else b"i%d" % h


def parse_engine_field(field: bytes) -> EngineBlockHash:
    return field[1:] if field[:1] == b"b" else int(field[1:])


def emap_value(mask: int, hashes: Sequence[BlockHash]) -> bytes:
    return bytes((mask,)) + b"".join(hashes)


def parse_emap_value(value: bytes) -> tuple[int, tuple[BlockHash, ...]]:
    n = BLOCK_HASH_BYTES
    return value[0], tuple(BlockHash(value[i : i + n]) for i in range(1, len(value), n))


def holders(value: bytes | None) -> dict[int, int]:
    """Slot → tiers of one residency value."""
    if not value:
        return {}
    return {
        (value[i] << 8) | value[i + 1]: value[i + 2] for i in range(0, len(value), RESIDENCY_ENTRY)
    }


def predicted_slots(value: bytes | None, now_ms: int) -> set[int]:
    """Slots with a prediction still live at ``now_ms`` in one prediction value."""
    if not value:
        return set()
    out = set()
    for i in range(0, len(value), PREDICTION_ENTRY):
        if int(value[i + 2 : i + PREDICTION_ENTRY]) > now_ms:
            out.add((value[i] << 8) | value[i + 1])
    return out

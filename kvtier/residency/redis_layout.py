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
``{t}:epoch``              string  bumped whenever a slot stops naming its node (readers cache
                                   slot names and drop them when it changes)
``{t}:res``                hash    block id → residency bitmap: bit ``2*slot`` (little-endian,
                                   as ``int.from_bytes(v, "little")`` reads it) set while the
                                   slot holds the block on GPU, ``2*slot + 1`` on CPU; no
                                   trailing zero bytes, no empty values
``{t}:pred``               hash    block id → predictions: 16-byte entries: slot (2 bytes),
                                   expiry (14 ASCII digits, ms on the Redis clock); the key
                                   expires with its longest-lived prediction
``{t}:pgc``                string  cursor of the incremental scan that drops expired
                                   prediction entries (each predict call scans as many fields
                                   as it writes)
``{t}:emap:<node>``        hash    the node's engine-hash map: engine hash (``i<int>`` or
                                   ``b<bytes>``) → media mask (1 byte) + its router hashes, so
                                   whichever replica writes the node's events next resolves
                                   removals of blocks stored before it took over
``{t}:seq:<node>``         string  sequence number of the node's last applied event batch
``{t}:lease:<node>``       string  the replica that writes the node's events (with a TTL)
``{t}:replicas``           zset    live proxy replicas → heartbeat expiry (written by the
                                   router's shared load; leases count them to share streams)
=========================  ======  ===========================================================

A block id is the first :data:`BLOCK_ID_BYTES` bytes of its router hash: blocks are hash fields,
not keys, so a script declares three keys whatever the prompt's length and the client sends
8 bytes per block, packed into one argument (a 512-block match sends 4 KiB, where a key name
per block sent ~40 KiB). Two blocks share an id with probability ~n²/2⁶⁵ for n stored blocks
(~3·10⁻⁴ at 10⁸ blocks); a collision can only misstate one match, never corrupt a write.

A residency value is a quarter byte per slot up to its highest holder: the match walk turns it
into one integer (C-level) and ANDs it along the chain, so a thousand nodes cost bytes, not
loops, and nodes that hold nothing add nothing to the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files

from kvtier.events.types import EngineBlockHash
from kvtier.keys import BLOCK_HASH_BYTES, BlockHash
from kvtier.residency.redis_client import hash_tag

MAX_SLOTS = 1 << 16
"""Slots per model (two bytes per entry): live and retired nodes together."""

TIER_GPU, TIER_CPU = 1, 2
PREDICTION_ENTRY = 16
BLOCK_ID_BYTES = 8


def script_source(name: str) -> str:
    """A Lua script beside this module (each names the keys it touches in its header)."""
    return files("kvtier.residency").joinpath(name).read_text(encoding="utf-8")


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
    epoch: bytes
    res: bytes
    pred: bytes
    pgc: bytes

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
            t + b":epoch",
            t + b":res",
            t + b":pred",
            t + b":pgc",
        )

    @property
    def meta(self) -> list[bytes]:
        """``KEYS[1..7]`` of apply.lua and predict.lua."""
        return [
            self.slots, self.names, self.nodes, self.retired, self.free, self.next, self.epoch,
        ]  # fmt: skip

    def emap(self, node: str) -> bytes:
        return f"{self.tag}:emap:{node}".encode()

    def seq(self, node: str) -> bytes:
        return f"{self.tag}:seq:{node}".encode()

    def lease(self, node: str) -> bytes:
        return f"{self.tag}:lease:{node}".encode()

    @property
    def replicas(self) -> bytes:
        """The live proxy replicas (kept by ``pdproxy.routing.kv.shared_load``)."""
        return f"{self.tag}:replicas".encode()


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


def block_ids(hashes: Sequence[BlockHash]) -> bytes:
    """The blocks' ids packed into one script argument (8 bytes each)."""
    return b"".join([h[:BLOCK_ID_BYTES] for h in hashes])


def block_id(h: BlockHash) -> bytes:
    return h[:BLOCK_ID_BYTES]


def residency_bits(value: bytes | None) -> int:
    """A residency bitmap as an integer: bit ``2*slot`` GPU, ``2*slot + 1`` CPU."""
    return int.from_bytes(value, "little") if value else 0


def holders(value: bytes | None) -> dict[int, int]:
    """Slot → tiers (TIER_GPU | TIER_CPU) of one residency value."""
    bits = residency_bits(value)
    out: dict[int, int] = {}
    while bits:
        low = bits & -bits
        pos = low.bit_length() - 1
        slot = pos >> 1
        out[slot] = out.get(slot, 0) | (TIER_CPU if pos & 1 else TIER_GPU)
        bits ^= low
    return out


def predicted_slots(value: bytes | None, now_ms: int) -> set[int]:
    """Slots with a prediction still live at ``now_ms`` in one prediction value."""
    if not value:
        return set()
    out = set()
    for i in range(0, len(value), PREDICTION_ENTRY):
        if int(value[i + 2 : i + PREDICTION_ENTRY]) > now_ms:
            out.add((value[i] << 8) | value[i + 1])
    return out

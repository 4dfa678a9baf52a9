"""Engine events → residency operations on router block hashes.

Engines hash blocks their own way, so an index cannot use ``block_hashes`` from events
directly. A ``BlockStored`` carries the blocks' ``token_ids`` and its parent's engine hash:
:class:`EngineHashMap` recomputes the router's chained hashes (:class:`kvtier.keys.BlockHasher`)
from the parent's router hash and keeps engine hash → router hashes, so a later
``BlockRemoved`` resolves. One map per node; both index implementations share it.

An engine block may span several router blocks (engine block size a multiple of the router's).
A chain's first block whose only extra hash key is a string (vLLM's form for a ``cache_salt``:
``extra_keys[0] == (salt,)``) is hashed under that salt, as the router hashes a request that
carries it. Events the router's hashes cannot represent are skipped and counted: LoRA blocks,
blocks with other extra hash keys (multimodal inputs), other KV-cache groups, unknown media, and
block sizes that are not a multiple of the router's.

A node's events decide how much the index holds for it, so each map has a block budget
(``max_blocks``, router blocks; :data:`DEFAULT_MAX_BLOCKS_PER_NODE` unless the index is given
another): a store past it evicts the map's oldest engine blocks (by the time they were last
stored), and :meth:`EngineHashMap.translate` returns their removal from every medium that held
them after the batch's own operations, so both index implementations forget exactly what the
map forgot. Evictions are counted (:attr:`TranslateStats.evicted`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.events.types import (
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
    Medium,
    event_medium,
)
from kvtier.keys import BlockHash, BlockHasher

MEDIUM_BIT = {Medium.GPU: 1, Medium.CPU: 2}

DEFAULT_MAX_BLOCKS_PER_NODE = 1 << 18
"""Router blocks an index holds per node by default: 262,144 (4 Mi tokens at 16 per block),
beyond a GPU's KV cache and a large host tier; a node past it loses its oldest blocks."""


@dataclass(frozen=True, slots=True)
class StoreOp:
    """``hashes`` became resident in ``medium``."""

    medium: Medium
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class RemoveOp:
    """``hashes`` left ``medium``."""

    medium: Medium
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class ClearOp:
    """The node dropped everything it held."""


ResidencyOp = StoreOp | RemoveOp | ClearOp


@dataclass(slots=True)
class TranslateStats:
    """What a node's events amounted to (counts of engine blocks unless noted)."""

    stored: int = 0
    removed: int = 0
    unresolved: int = 0
    """Blocks whose parent (stores) or own engine hash (removals) the map does not know."""
    skipped: int = 0
    """Blocks the router's hashes cannot represent (see the module docstring)."""
    clears: int = 0
    """AllBlocksCleared events."""
    evicted: int = 0
    """Blocks forgotten, oldest first, to keep the node within its block budget."""


_Entry = tuple[int, tuple[BlockHash, ...]]
"""(media mask, router hashes) of one engine block. A tuple of ints and bytes, so the
collector stops tracking it after its first pass: a router knows hundreds of thousands of
engine blocks, and objects it tracks (a ``__slots__`` class) made a full collection walk every
one of them (hundreds of ms at 1,024 nodes, a pause that lands in some decision's time)."""


class EngineHashMap:
    """One node's engine hash → router hashes map, and the media holding each engine block,
    oldest first."""

    def __init__(
        self,
        hasher: BlockHasher,
        group_idx: int = 0,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS_PER_NODE,
    ) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks_per_node must be positive, got {max_blocks}")
        self._hasher = hasher
        self._group = group_idx
        self._max_blocks = max_blocks
        self._entries: dict[EngineBlockHash, _Entry] = {}
        self._blocks = 0
        """Router blocks of every entry (what the budget counts)."""
        self.evicted: list[EngineBlockHash] = []
        """Engine hashes the last :meth:`translate` evicted (the Redis index deletes them from
        its shared map)."""
        self.stats = TranslateStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """Router blocks the map holds (at most ``max_blocks`` after each translate)."""
        return self._blocks

    def clear(self) -> None:
        self._entries.clear()
        self._blocks = 0

    def unknown(self, batch: EventBatch) -> set[EngineBlockHash]:
        """Engine hashes ``batch`` needs (parents of stores, removed blocks) that this map does
        not hold; a replica that took over a node's stream fetches them from the shared map."""
        out: set[EngineBlockHash] = set()
        stored: set[EngineBlockHash] = set()
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                if parent is not None and parent not in self._entries and parent not in stored:
                    out.add(parent)
                stored.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                out.update(h for h in event.block_hashes if h not in self._entries)
            else:
                break  # after a clear, nothing from before matters
        return out

    def load(self, engine_hash: EngineBlockHash, mask: int, hashes: tuple[BlockHash, ...]) -> None:
        """An entry learnt from the shared map (the next translate enforces the budget)."""
        if mask and hashes:
            old = self._entries.pop(engine_hash, None)
            if old is not None:
                self._blocks -= len(old[1])
            self._entries[engine_hash] = (mask, hashes)
            self._blocks += len(hashes)

    def entry(self, engine_hash: EngineBlockHash) -> tuple[int, tuple[BlockHash, ...]] | None:
        """(media mask, router hashes) of one engine block, or None."""
        return self._entries.get(engine_hash)

    def entries(self) -> list[tuple[EngineBlockHash, int, tuple[BlockHash, ...]]]:
        return [(h, mask, hashes) for h, (mask, hashes) in self._entries.items()]

    def translate(self, batch: EventBatch) -> list[ResidencyOp]:
        """Update the map with ``batch`` and return what changed, in router hashes (evictions
        last: :attr:`evicted` names their engine hashes)."""
        ops: list[ResidencyOp] = []
        op: ResidencyOp | None
        self.evicted = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                op = self._stored(event)
            elif isinstance(event, BlockRemoved):
                op = self._removed(event)
            else:
                self.clear()
                self.stats.clears += 1
                op = ClearOp()
            if op is not None:
                ops.append(op)
        if self._blocks > self._max_blocks:
            ops.extend(self._evict())
        return ops

    def _evict(self) -> list[RemoveOp]:
        """Drop the oldest entries until the map is within its budget; their removal ops."""
        gone: dict[Medium, list[BlockHash]] = {m: [] for m in MEDIUM_BIT}
        excess = self._blocks - self._max_blocks
        # One pass from the oldest (``next(iter())`` per entry would rescan the slots earlier
        # pops left at the front of the dict: quadratic in the entries evicted).
        for engine_hash, (mask, hashes) in self._entries.items():
            if excess <= 0:
                break
            excess -= len(hashes)
            self.evicted.append(engine_hash)
            for medium, bit in MEDIUM_BIT.items():
                if mask & bit:
                    gone[medium].extend(hashes)
        for engine_hash in self.evicted:
            self._blocks -= len(self._entries.pop(engine_hash)[1])
        self.stats.evicted += len(self.evicted)
        return [RemoveOp(m, tuple(h)) for m, h in gone.items() if h]

    def snapshot(self) -> list[StoreOp]:
        """Everything the map knows to be resident, as store operations (for a resync)."""
        by_medium: dict[Medium, list[BlockHash]] = {m: [] for m in MEDIUM_BIT}
        for mask, hashes in self._entries.values():
            for medium, bit in MEDIUM_BIT.items():
                if mask & bit:
                    by_medium[medium].extend(hashes)
        return [StoreOp(m, tuple(h)) for m, h in by_medium.items() if h]

    def _representable(self, event: BlockStored) -> bool:
        if event.group_idx is not None and event.group_idx != self._group:
            return False
        if event.lora_id is not None or event.lora_name is not None:
            return False
        extra = event.extra_keys
        if extra is not None and any(k is not None for k in extra[1:]):
            return False
        if extra and extra[0] is not None and _salt_of(event) is None:
            return False
        return (
            event.block_size % self._hasher.block_size == 0
            and len(event.token_ids) == len(event.block_hashes) * event.block_size
        )

    def _stored(self, event: BlockStored) -> StoreOp | None:
        n = len(event.block_hashes)
        medium = event_medium(event.medium)
        if medium is None or not self._representable(event):
            self.stats.skipped += n
            return None
        parent: BlockHash | None = None
        if event.parent_block_hash is not None:
            parent_entry = self._entries.get(event.parent_block_hash)
            if parent_entry is None:
                self.stats.unresolved += n
                return None
            parent = parent_entry[1][-1]
        ours = self._hasher.hash_tokens(
            event.token_ids,
            parent=parent,
            first_block_index=0 if parent is None else 1,
            cache_salt=_salt_of(event),
        )
        per = event.block_size // self._hasher.block_size
        bit = MEDIUM_BIT[medium]
        entries = self._entries
        for i, engine_hash in enumerate(event.block_hashes):
            mine = tuple(ours[i * per : (i + 1) * per])
            # Popped and put back: a block stored again is the newest (the last to be evicted).
            entry = entries.pop(engine_hash, None)
            if entry is None:
                entries[engine_hash] = (bit, mine)
                self._blocks += len(mine)
            else:
                entries[engine_hash] = (entry[0] | bit, mine)
                self._blocks += len(mine) - len(entry[1])
        self.stats.stored += n
        return StoreOp(medium, tuple(ours))

    def _removed(self, event: BlockRemoved) -> RemoveOp | None:
        medium = event_medium(event.medium)
        if medium is None or (event.group_idx is not None and event.group_idx != self._group):
            self.stats.skipped += len(event.block_hashes)
            return None
        bit = MEDIUM_BIT[medium]
        gone: list[BlockHash] = []
        for engine_hash in event.block_hashes:
            entry = self._entries.get(engine_hash)
            if entry is None or not entry[0] & bit:
                self.stats.unresolved += 1
                continue
            mask, hashes = entry[0] & ~bit, entry[1]
            gone.extend(hashes)
            if mask:
                self._entries[engine_hash] = (mask, hashes)  # keeps its age
            else:
                del self._entries[engine_hash]
                self._blocks -= len(hashes)
            self.stats.removed += 1
        return RemoveOp(medium, tuple(gone)) if gone else None


def _salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` of a chain's first block (``extra_keys[0] == (salt,)``), else None."""
    extra = event.extra_keys
    if not extra or event.parent_block_hash is not None:
        return None
    first = extra[0]
    if isinstance(first, (list, tuple)) and len(first) == 1 and isinstance(first[0], str):
        return first[0] or None
    return None

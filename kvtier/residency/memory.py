"""In-process residency index (the embedded default).

Each known node owns one position ``k`` (the lowest free one; no cap unless ``max_nodes`` is
given). One dict maps a router block hash to a packed integer with four bits per node, at
``4k`` .. ``4k + 3``: the node holds the block on GPU, on CPU, in any tier, and in any tier or
predicted. ``match`` is then one C-level pass over the prompt: ``accumulate(masks, and_)``
keeps the running AND of all four tiers of every node at once, ``takewhile`` stops at the first
block no node holds, and the positions where bits leave the running AND are the nodes' prefix
lengths per tier. A node that holds none of the prompt's blocks adds no bit to its masks, so the
cost of a match follows the nodes that hold its blocks, not the number of nodes known; a match
``among`` a decision's candidates starts the running AND from their bits only, so it stops at
the first block no candidate holds and extracts a handful of bits. Per-node sets keep what each
node holds so ``forget`` and ``AllBlocksCleared`` are exact.

Each node holds at most ``max_blocks_per_node`` blocks from its events (its engine-hash map's
budget, :mod:`kvtier.residency.translate`): past it its oldest blocks are forgotten and counted
in :meth:`MemoryIndex.translate_stats`, so a node that floods events costs a bounded amount of
memory. Predictions are bounded by their TTL instead.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import accumulate, groupby, repeat, takewhile
from operator import and_

from kvtier.errors import ResidencyError
from kvtier.events.types import EventBatch, Medium
from kvtier.keys import BlockHash, BlockHasher
from kvtier.residency.translate import (
    DEFAULT_MAX_BLOCKS_PER_NODE,
    ClearOp,
    EngineHashMap,
    RemoveOp,
    ResidencyOp,
    StoreOp,
    TranslateStats,
)
from kvtier.residency.types import Match, NodeId

_GPU, _CPU, _ANY, _SEEN = range(4)
"""A node's bits in the packed masks; ``_SEEN`` is any tier or predicted."""
_FIELDS = 4
_NODE_BITS = (1 << _FIELDS) - 1


def _positions(bits: int) -> list[int]:
    """Positions of the set bits of ``bits`` (≥ 0).

    Few bits (a node or two leaving the running AND): one ``bit_length`` per bit. Many:
    ``bin`` and ``str.find`` in C, one step per set bit, where ``bits & -bits`` would allocate
    an integer as wide as ``bits`` (4,096 bits at 1,024 nodes) per set bit.
    """
    if bits.bit_count() <= 8:
        out = []
        while bits:
            top = bits.bit_length() - 1
            out.append(top)
            bits ^= 1 << top
        return out
    text = bin(bits)[:1:-1]
    out = []
    find = text.find
    pos = find("1")
    while pos >= 0:
        out.append(pos)
        pos = find("1", pos + 1)
    return out


def _drops(masks: Iterable[int], keep: int) -> dict[int, int]:
    """Bit position → length of the leading run of ``masks`` that all contain it, for the
    bits of ``keep`` (-1: all); a bit in no leading mask is absent."""
    out: dict[int, int] = {}
    pos = 0
    prev = 0
    running = accumulate(masks, and_, initial=keep)
    next(running)  # ``keep`` itself
    for value, run in groupby(takewhile(bool, running)):
        gone = prev & ~value
        if gone:
            for bit in _positions(gone):
                out[bit] = pos
        pos += len(list(run))
        prev = value
    for bit in _positions(prev):
        out[bit] = pos
    return out


class _Node:
    __slots__ = ("cpu", "gpu", "index", "name", "pred")

    def __init__(self, name: NodeId, index: int) -> None:
        self.name = name
        self.index = index
        self.gpu: set[BlockHash] = set()
        self.cpu: set[BlockHash] = set()
        self.pred: dict[BlockHash, float] = {}


class MemoryIndex:
    """:class:`kvtier.residency.types.ResidencyIndex` held in this process.

    ``clock`` returns seconds (monotonic); predictions expire ``ttl_s`` after ``predict``.
    ``group_idx`` selects the KV-cache group whose events are indexed. Without ``max_nodes``
    any number of nodes is known at once; with it, at most that many (a forgotten node's
    position is reused either way). ``max_blocks_per_node``: the router blocks one node's
    events may keep indexed (its oldest go first).
    """

    def __init__(
        self,
        hasher: BlockHasher,
        *,
        group_idx: int = 0,
        max_nodes: int | None = None,
        max_blocks_per_node: int = DEFAULT_MAX_BLOCKS_PER_NODE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_nodes is not None and max_nodes <= 0:
            raise ValueError(f"max_nodes must be positive, got {max_nodes}")
        if max_blocks_per_node <= 0:
            raise ValueError(f"max_blocks_per_node must be positive, got {max_blocks_per_node}")
        self._max_blocks = max_blocks_per_node
        self._hasher = hasher
        self._group = group_idx
        self._clock = clock
        self._cap = max_nodes
        self._next = 0
        self._nodes: dict[NodeId, _Node] = {}
        self._by_index: dict[int, _Node] = {}
        self._free: list[int] = []
        """Positions of forgotten nodes, reused lowest first (keeps the masks short)."""
        self._maps: dict[NodeId, EngineHashMap] = {}
        self._masks: dict[BlockHash, int] = {}
        self._expiries: list[tuple[float, int, BlockHash]] = []

    def translate_stats(self, node: NodeId) -> TranslateStats:
        """How ``node``'s events translated since it was last forgotten."""
        m = self._maps.get(node)
        return m.stats if m is not None else TranslateStats()

    @staticmethod
    def _bit(index: int, field: int) -> int:
        return 1 << (index * _FIELDS + field)

    def _node(self, name: NodeId) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            if self._cap is not None and len(self._nodes) >= self._cap:
                raise ResidencyError(f"MemoryIndex tracks at most {self._cap} nodes")
            if self._free:
                index = heapq.heappop(self._free)
            else:
                index, self._next = self._next, self._next + 1
            node = self._nodes[name] = _Node(name, index)
            self._by_index[node.index] = node
        return node

    async def apply(self, node: NodeId, batch: object) -> None:
        if not isinstance(batch, EventBatch):
            raise TypeError(f"expected an EventBatch, got {type(batch).__name__}")
        emap = self._maps.get(node)
        if emap is None:
            emap = self._maps[node] = EngineHashMap(
                self._hasher, self._group, max_blocks=self._max_blocks
            )
        self.apply_ops(node, emap.translate(batch))

    async def apply_many(self, items: Sequence[tuple[NodeId, EventBatch]]) -> None:
        """Apply several batches in order (the Redis index pipelines these)."""
        for node, batch in items:
            await self.apply(node, batch)

    def apply_ops(self, name: NodeId, ops: Sequence[ResidencyOp]) -> None:
        """Apply already translated operations (router hashes)."""
        node = self._node(name)
        for op in ops:
            if isinstance(op, StoreOp):
                self._store(node, op.medium, op.hashes)
            elif isinstance(op, RemoveOp):
                self._remove(node, op.medium, op.hashes)
            elif isinstance(op, ClearOp):
                self._clear(node)

    def _store(self, node: _Node, medium: Medium, hashes: Sequence[BlockHash]) -> None:
        field = _GPU if medium is Medium.GPU else _CPU
        bits = self._bit(node.index, field) | self._bit(node.index, _ANY)
        bits |= self._bit(node.index, _SEEN)
        masks = self._masks
        get = masks.get
        for h in hashes:
            masks[h] = get(h, 0) | bits
        (node.gpu if medium is Medium.GPU else node.cpu).update(hashes)

    def _unset(self, h: BlockHash, bits: int) -> None:
        left = self._masks.get(h, 0) & ~bits
        if left:
            self._masks[h] = left
        else:
            self._masks.pop(h, None)

    def _remove(self, node: _Node, medium: Medium, hashes: Sequence[BlockHash]) -> None:
        if medium is Medium.GPU:
            held, other, field = node.gpu, node.cpu, _GPU
        else:
            held, other, field = node.cpu, node.gpu, _CPU
        tier_bit = self._bit(node.index, field)
        any_bit = self._bit(node.index, _ANY)
        seen_bit = self._bit(node.index, _SEEN)
        for h in hashes:
            if h not in held:
                continue
            held.discard(h)
            bits = tier_bit
            if h not in other:
                bits |= any_bit
                if h not in node.pred:
                    bits |= seen_bit
            self._unset(h, bits)

    def _clear(self, node: _Node) -> None:
        every = sum(self._bit(node.index, f) for f in (_GPU, _CPU, _ANY, _SEEN))
        for h in (*node.gpu, *node.cpu, *node.pred):
            self._unset(h, every)
        node.gpu.clear()
        node.cpu.clear()
        node.pred.clear()

    def _expire(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, index, h = heapq.heappop(heap)
            node = self._by_index.get(index)
            if node is not None and node.pred.get(h) == expiry:
                del node.pred[h]
                if h not in node.gpu and h not in node.cpu:
                    self._unset(h, self._bit(index, _SEEN))

    async def match(
        self, hashes: Sequence[BlockHash], among: Collection[NodeId] | None = None
    ) -> dict[NodeId, Match]:
        self._expire(self._clock())
        keep = -1
        if among is not None:
            keep = 0
            for name in among:
                node = self._nodes.get(name)
                if node is not None:
                    keep |= _NODE_BITS << (node.index * _FIELDS)
            if not keep:
                return {}
        lengths: dict[int, list[int]] = {}
        for bit, length in _drops(map(self._masks.get, hashes, repeat(0)), keep).items():
            index, field = divmod(bit, _FIELDS)
            row = lengths.get(index)
            if row is None:
                row = lengths[index] = [0, 0, 0, 0]
            row[field] = length
        by_index = self._by_index
        return {
            by_index[i].name: Match(gpu=g, cpu=c, total=t, predicted=p)
            for i, (g, c, t, p) in lengths.items()
            if p
        }

    async def predict(self, node: NodeId, hashes: Sequence[BlockHash], ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        state = self._node(node)
        expiry = self._clock() + ttl_s
        index = state.index
        seen_bit = self._bit(index, _SEEN)
        masks = self._masks
        for h in hashes:
            state.pred[h] = expiry
            heapq.heappush(self._expiries, (expiry, index, h))
            masks[h] = masks.get(h, 0) | seen_bit

    async def forget(self, node: NodeId) -> None:
        self._maps.pop(node, None)
        state = self._nodes.pop(node, None)
        if state is None:
            return
        self._clear(state)
        del self._by_index[state.index]
        heapq.heappush(self._free, state.index)

    async def nodes(self) -> list[NodeId]:
        return list(self._nodes)

    async def close(self) -> None:
        for name in list(self._nodes):
            await self.forget(name)
        self._expiries.clear()
        self._masks.clear()

"""Residency events of the worker: device prefix cache (GPU medium) and host tier (CPU medium).

The engine reports blocks entering and leaving its full-attention group's prefix cache; the
tiering manager reports host pages stored and evicted. Events are batched and published over
ZMQ in vLLM's format by :class:`kvtier.events.EventPublisher` every ``interval_s``.

``BlockStored`` carries the block's token ids and parent hash (the router recomputes its own
hashes from them); a CPU store is published once the block's tokens are known from a device
store on this worker (a bounded memory), otherwise it is skipped and counted.

Blocks of a LoRA adapter's requests (:meth:`KVEventRelay.mark_adapter`, and any block whose
parent is one) are published with the adapter's ``lora_id`` and ``lora_name`` as vLLM does, so
a router never takes them for base-model blocks.

The first block of a request with a ``cache_salt`` (:meth:`KVEventRelay.mark_salted`) is
published with ``extra_keys`` ``[(salt,), None, ...]``, vLLM's form (the salt is block 0's only
extra key), so a router hashes it under the same salt and never takes it for an unsalted block;
its descendants carry the salt through their parent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.events import BlockRemoved, BlockStored, EventBatch, EventPublisher, KVEvent, Medium
from kvtier.keys import BlockHash, split_offload_key
from kvtier.offload.types import OffloadEvent
from kvtier.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

PREFIX_GROUP = 0
"""The full-attention group: its residency is what a prefix match means."""

OffloadEventSource = Callable[[], list[OffloadEvent]]


class KVEventRelay:
    """Collects cache changes and publishes them as event batches."""

    def __init__(
        self,
        publisher: EventPublisher | None,
        block_size: int,
        *,
        interval_s: float = 0.02,
        token_memory: int = 65_536,
    ) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.interval_s = interval_s
        self._pending: list[KVEvent] = []
        self._blocks: OrderedDict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = (
            OrderedDict()
        )
        self._token_memory = token_memory
        self._adapters: OrderedDict[BlockHash, tuple[int, str]] = OrderedDict()
        """Block hash -> (lora_id, lora_name) of adapter blocks (bounded like the tokens)."""
        self._salts: OrderedDict[BlockHash, str] = OrderedDict()
        """First block's hash -> its ``cache_salt`` (bounded like the tokens)."""
        self._sources: list[OffloadEventSource] = []
        self._task: asyncio.Task[None] | None = None
        self.published_batches = 0
        self.skipped_cpu_stores = 0

    def add_source(self, source: OffloadEventSource) -> None:
        """A host-tier event source (``TieringManager.take_events``), polled at each flush."""
        self._sources.append(source)

    # -- collection (engine loop) --------------------------------------------------------------
    def on_device_stored(
        self, group: int, block_hash: BlockHash, parent: BlockHash | None, tokens: Sequence[int]
    ) -> None:
        if group != PREFIX_GROUP:
            return
        self._blocks[block_hash] = (parent, tuple(tokens))
        self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self._token_memory:
            self._blocks.popitem(last=False)
        self._stored(block_hash, parent, tuple(tokens), Medium.GPU)

    def mark_adapter(self, hashes: Sequence[BlockHash], lora_id: int, lora_name: str) -> None:
        """``hashes`` belong to a request running under a LoRA adapter."""
        for block_hash in hashes:
            self._adapters[block_hash] = (lora_id, lora_name)
            self._adapters.move_to_end(block_hash)
        while len(self._adapters) > self._token_memory:
            self._adapters.popitem(last=False)

    def mark_salted(self, first_block: BlockHash, cache_salt: str) -> None:
        """``first_block`` (a prompt's block 0) was hashed under ``cache_salt``."""
        self._salts[first_block] = cache_salt
        self._salts.move_to_end(first_block)
        while len(self._salts) > self._token_memory:
            self._salts.popitem(last=False)

    def _adapter_of(
        self, block_hash: BlockHash, parent: BlockHash | None
    ) -> tuple[int, str] | None:
        adapter = self._adapters.get(block_hash)
        if adapter is None and parent is not None:
            adapter = self._adapters.get(parent)
            if adapter is not None:  # a generated block continuing an adapter's chain
                self._adapters[block_hash] = adapter
        return adapter

    def remember(self, hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> None:
        """Learn blocks' tokens before they reach a tier (a consumer's fetched host pages)."""
        bs = self.block_size
        for i, block_hash in enumerate(hashes):
            parent = hashes[i - 1] if i > 0 else None
            self._blocks[block_hash] = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self._token_memory:
            self._blocks.popitem(last=False)

    def on_device_removed(self, group: int, hashes: list[BlockHash]) -> None:
        if group == PREFIX_GROUP and hashes:
            self._pending.append(BlockRemoved(tuple(hashes), Medium.GPU.value, PREFIX_GROUP))

    def on_offload_events(self, events: Sequence[OffloadEvent]) -> None:
        for event in events:
            medium = Medium.CPU if event.medium.upper() == Medium.CPU.value else None
            if medium is None:
                continue
            hashes = [h for h, g in map(split_offload_key, event.keys) if g == PREFIX_GROUP]
            if not hashes:
                continue
            if event.removed:
                self._pending.append(BlockRemoved(tuple(hashes), medium.value, PREFIX_GROUP))
                continue
            for h in hashes:
                known = self._blocks.get(h)
                if known is None:
                    self.skipped_cpu_stores += 1
                    continue
                self._stored(h, known[0], known[1], medium)

    def _stored(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        tokens: tuple[int, ...],
        medium: Medium,
    ) -> None:
        adapter = self._adapter_of(block_hash, parent)
        lora_id, lora_name = adapter if adapter is not None else (None, None)
        last = self._pending[-1] if self._pending else None
        if (
            isinstance(last, BlockStored)
            and last.medium == medium.value
            and parent is not None
            and last.block_hashes[-1] == parent
            and last.lora_name == lora_name
        ):
            extra = last.extra_keys
            self._pending[-1] = BlockStored(
                block_hashes=(*last.block_hashes, block_hash),
                parent_block_hash=last.parent_block_hash,
                token_ids=last.token_ids + tokens,
                block_size=self.block_size,
                lora_id=lora_id,
                medium=medium.value,
                lora_name=lora_name,
                extra_keys=None if extra is None else (*extra, None),
                group_idx=PREFIX_GROUP,
            )
            return
        salt = self._salts.get(block_hash) if parent is None else None
        self._pending.append(
            BlockStored(
                block_hashes=(block_hash,),
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=lora_id,
                medium=medium.value,
                lora_name=lora_name,
                extra_keys=None if salt is None else ((salt,),),
                group_idx=PREFIX_GROUP,
            )
        )

    def take_batch(self) -> EventBatch | None:
        """Everything collected since the last call (host-tier sources polled first)."""
        for source in self._sources:
            self.on_offload_events(source())
        if not self._pending:
            return None
        events, self._pending = tuple(self._pending), []
        return EventBatch(ts=time.time(), events=events)

    # -- publishing ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.publisher is None or self._task is not None:
            return
        await self.publisher.start()
        self._task = asyncio.create_task(self._flush_loop(), name="kvtier-kv-events")

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        batch = self.take_batch()
        if batch is not None and self.publisher is not None:
            await self.publisher.publish(batch)
            self.published_batches += 1

    async def close(self) -> None:
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        finally:
            if task is not None:
                try:
                    await self.flush()
                except Exception:
                    logger.exception("final KV event flush failed")
            if self.publisher is not None:
                await self.publisher.close()

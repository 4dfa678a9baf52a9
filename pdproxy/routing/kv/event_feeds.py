"""KV event subscriptions: each backend's events applied to the residency index.

Batches go straight to the index, never through the router's breaker: an index that fails an
apply knows it missed events and resyncs the node on its next successful apply (RedisIndex does),
whereas a batch the router skipped would be lost silently. Failures are counted and logged once
per outage. Lost events (the subscriber's reset) forget the node. Nothing here raises into the
subscriber.

With a shared index and :class:`~pdproxy.routing.kv.stream_leases.StreamLeases`, only the
replica holding a worker's lease applies (and, on lost events, forgets) that worker's events;
the others follow the stream and drop its batches. A replica that takes a lease resubscribes
from the sequence after the last one applied, so the worker's replay socket fills the gap. A
shared index without leases (a replica joining late) keeps the shared state on a reset that
comes before its first batch.

A batch tagged with a data-parallel rank other than its socket's (:mod:`pdproxy.fleet.dp_ranks`)
is dropped and counted, never applied.

Event sockets carry prompt token ids. With ``events_curve`` keys every subscription (live and
replay) is CURVE-encrypted and checks the worker's public key; a backend whose server key is not
configured is refused a subscription (logged) rather than followed in plain text. Key files are
read once, at construction; a missing or malformed one is a :class:`ConfigError` naming the file.

Whoever publishes (or reaches a bound subscriber) may flood. No message past
``max_message_bytes`` is read (the subscriber's ``ZMQ_MAXMSGSIZE``); the index keeps each node
within its block budget (``max_blocks_per_node``, evicting the oldest); and a batch is applied in
slices of about ``apply_blocks`` blocks, a long event split along its blocks (the split hashes
the same: each piece continues the chain from its predecessor's last block), the loop yielded to
between slices so that other requests go on while a large batch is applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import EventSecurityError, ResidencyError
from kvtier.events import EventBatch, EventSubscriber
from kvtier.events.curve import CurveClient, load_client
from kvtier.events.subscriber import DEFAULT_MAX_MESSAGE_BYTES
from kvtier.events.types import BlockRemoved, BlockStored, KVEvent
from kvtier.residency.types import NodeId, ResidencyIndex
from pdproxy.errors import ConfigError
from pdproxy.fleet.dp_ranks import batch_rank_refused
from pdproxy.settings.routing import EventsCurveSettings

if TYPE_CHECKING:
    from pdproxy.routing.kv.scorers.index_exactness import IndexExactness
    from pdproxy.routing.kv.stream_leases import StreamLeases

logger = logging.getLogger(__name__)


class EventFeeds:
    def __init__(
        self,
        index: ResidencyIndex,
        on_apply_error: Callable[[], None],
        *,
        shared: bool = False,
        replay_timeout_s: float = 1.0,
        curve: EventsCurveSettings | None = None,
        leases: StreamLeases | None = None,
        on_rank_refused: Callable[[NodeId], None] | None = None,
        exactness: IndexExactness | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        apply_blocks: int = 1024,
    ) -> None:
        """``exactness`` follows each stream's gaps, replays and losses. ``max_message_bytes``:
        each subscription's cap; ``apply_blocks``: the size of one applied slice (blocks)."""
        self._max_message_bytes = max_message_bytes
        self._apply_blocks = apply_blocks
        self._on_rank_refused = on_rank_refused
        self._exactness = exactness
        self._clock = clock
        self._keys = _FeedKeys(curve) if curve is not None else None
        self._index = index
        self._shared = shared
        self._on_apply_error = on_apply_error
        self._replay_timeout_s = replay_timeout_s
        self._subs: dict[NodeId, EventSubscriber] = {}
        self._endpoints: dict[NodeId, tuple[str, str | None, bool]] = {}
        self._failing: set[NodeId] = set()
        self.leases = leases
        self._lease_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Keep this replica's leases (when it has any to keep) until :meth:`close`."""
        if self.leases is not None and self._lease_task is None:
            self._lease_task = asyncio.create_task(self._keep_leases(), name="kv-event leases")

    async def _keep_leases(self) -> None:
        leases = self.leases
        assert leases is not None
        while True:
            await asyncio.sleep(leases.renew_s)
            streams = len(self._subs)
            for node in list(self._subs):
                start_seq = await leases.take(node, streams)
                if start_seq is not None and node in self._endpoints:
                    # Taken over: follow from what the last writer applied.
                    endpoint, replay, listen = self._endpoints[node]
                    await self._start_sub(node, endpoint, replay, start_seq, listen)
            await leases.balance(streams)

    @property
    def nodes(self) -> list[NodeId]:
        return sorted(self._subs)

    def subscriber(self, node: str) -> EventSubscriber | None:
        return self._subs.get(NodeId(node))

    async def subscribe(
        self, node: str, endpoint: str, replay_endpoint: str | None, *, listen: bool = False
    ) -> None:
        """Follow ``node``'s events (replacing an earlier subscription of the same node);
        ``listen``: bind ``endpoint`` for the engine to connect (``events_listen``)."""
        nid = NodeId(node)
        await self.unsubscribe(node)
        if self._keys is not None and self._keys.for_node(node) is None:
            logger.error(
                "KV events for %s not followed: events_curve names no server key for it", node
            )
            return
        self._endpoints[nid] = (endpoint, replay_endpoint, listen)
        start_seq = 0
        if self.leases is not None:
            start_seq = await self.leases.take(nid) or 0
        await self._start_sub(nid, endpoint, replay_endpoint, start_seq, listen)

    async def _start_sub(
        self,
        nid: NodeId,
        endpoint: str,
        replay_endpoint: str | None,
        start_seq: int,
        listen: bool = False,
    ) -> None:
        old = self._subs.pop(nid, None)
        if old is not None:
            await old.close()
        delivered = False
        leases = self.leases
        exactness = self._exactness
        if exactness is not None:
            exactness.track(nid, self._clock())

        def on_gap(seq: int | None) -> None:
            if exactness is not None:
                exactness.gap(nid, seq, self._clock())

        async def on_batch(batch: EventBatch) -> None:
            nonlocal delivered
            delivered = True
            if exactness is not None:
                exactness.delivered(nid, sub.next_seq - 1, self._clock())
            if batch_rank_refused(nid, batch):
                # Tagged with another data-parallel rank than its socket's: never applied.
                if self._on_rank_refused is not None:
                    self._on_rank_refused(nid)
                return
            if leases is None:
                await self._apply(nid, batch, None)
            elif leases.holds(nid):
                await self._apply(nid, batch, sub.next_seq - 1)

        async def on_reset() -> None:
            if leases is not None and not leases.holds(nid):
                return  # the writer of this stream handles it
            if leases is None and self._shared and not delivered:
                logger.info("KV events for %s: joining late; the shared index keeps its state", nid)
                return
            if exactness is not None:
                exactness.lost(nid, self._clock())
            await self._forget(nid)

        sub = EventSubscriber(
            endpoint,
            replay_endpoint,
            on_batch=on_batch,
            on_reset=on_reset,
            replay_timeout_s=self._replay_timeout_s,
            name=f"{nid}@{endpoint}",
            curve=self._keys.for_node(nid) if self._keys is not None else None,
            start_seq=start_seq,
            bind=listen,
            on_gap=on_gap,
            max_message_bytes=self._max_message_bytes,
        )
        self._subs[nid] = sub
        await sub.start()

    async def unsubscribe(self, node: str) -> None:
        nid = NodeId(node)
        self._endpoints.pop(nid, None)
        if self._exactness is not None:
            self._exactness.untrack(nid)
        sub = self._subs.pop(nid, None)
        if sub is not None:
            await sub.close()
        if self.leases is not None:
            await self.leases.drop(nid)

    async def close(self) -> None:
        task, self._lease_task = self._lease_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for node in list(self._subs):
            await self.unsubscribe(node)

    async def _apply(self, node: NodeId, batch: EventBatch, seq: int | None) -> None:
        """Apply ``batch`` slice by slice, yielding to the loop between slices. Under a lease
        the slices before the last record ``seq - 1``: a replica taking the stream over after a
        partial batch replays it whole (stores and removals apply again to the same effect)."""
        slices = list(batch_slices(batch, self._apply_blocks))
        for i, piece in enumerate(slices):
            if i:
                await asyncio.sleep(0)
            last = i == len(slices) - 1
            if not await self._apply_slice(node, piece, seq if last or seq is None else seq - 1):
                return

    async def _apply_slice(self, node: NodeId, batch: EventBatch, seq: int | None) -> bool:
        try:
            if self.leases is None or seq is None:
                await self._index.apply(node, batch)
            else:
                await self.leases.apply(node, batch, seq)
        except ResidencyError as exc:
            if self.leases is not None and "NOTOWNER" in str(exc):
                self.leases.lost(node)
                return False
            if node not in self._failing:
                logger.warning("KV events for %s not applied (%s)", node, exc)
            self._failing.add(node)
            self._on_apply_error()
            return False
        if node in self._failing:
            self._failing.discard(node)
            logger.info("KV events for %s apply again", node)
        return True

    async def _forget(self, node: NodeId) -> None:
        try:
            await self._index.forget(node)
        except ResidencyError as exc:
            logger.warning("KV events for %s were lost and forget failed: %s", node, exc)


def batch_slices(batch: EventBatch, blocks: int) -> Iterator[EventBatch]:
    """``batch`` as consecutive batches of about ``blocks`` blocks each (one when it is small).
    A long plain ``BlockStored`` or ``BlockRemoved`` is split along its blocks; an event that
    cannot be split (per-block extra keys, inconsistent token count) stays whole."""
    if sum(_blocks(e) for e in batch.events) <= blocks:
        yield batch
        return
    pending: list[KVEvent] = []
    size = 0
    for event in batch.events:
        for piece in _split(event, blocks):
            n = _blocks(piece)
            if pending and size + n > blocks:
                yield EventBatch(batch.ts, tuple(pending), batch.data_parallel_rank)
                pending, size = [], 0
            pending.append(piece)
            size += n
    if pending:
        yield EventBatch(batch.ts, tuple(pending), batch.data_parallel_rank)


def _blocks(event: KVEvent) -> int:
    return len(event.block_hashes) if isinstance(event, BlockStored | BlockRemoved) else 1


def _split(event: KVEvent, blocks: int) -> Iterator[KVEvent]:
    n = _blocks(event)
    if n <= blocks:
        yield event
    elif isinstance(event, BlockRemoved):
        for i in range(0, n, blocks):
            yield replace(event, block_hashes=event.block_hashes[i : i + blocks])
    elif not isinstance(event, BlockStored) or event.extra_keys is not None:
        yield event
    elif len(event.token_ids) != n * event.block_size:
        yield event  # the translator skips it whole
    else:
        size = event.block_size
        for i in range(0, n, blocks):
            yield replace(
                event,
                block_hashes=event.block_hashes[i : i + blocks],
                parent_block_hash=event.parent_block_hash if i == 0 else event.block_hashes[i - 1],
                token_ids=event.token_ids[i * size : (i + blocks) * size],
            )


class _FeedKeys:
    """The proxy's client certificate and each worker's public one, loaded once."""

    def __init__(self, settings: EventsCurveSettings) -> None:
        secret = settings.client_secret_key_file
        self._shared = self._load(secret, settings.server_public_key_file)
        self._per_node = {
            node: keys
            for node, path in settings.server_public_key_files.items()
            if (keys := self._load(secret, path)) is not None
        }

    def for_node(self, node: str) -> CurveClient | None:
        return self._per_node.get(node, self._shared)

    @staticmethod
    def _load(secret: Path, server_public: Path | None) -> CurveClient | None:
        if server_public is None:
            return None
        try:
            return load_client(secret, server_public)
        except EventSecurityError as exc:
            raise ConfigError(f"events_curve: {exc}") from exc

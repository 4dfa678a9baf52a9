"""Consumer side: a producer's answer to one ``fetch`` frame, received into the sink's pages.

:class:`BlockReceiver` reads ``blocks`` headers (each must name exactly the next demanded keys,
each with its layout's size) and ``fail`` frames until every demanded key is accounted for.
Every payload is received straight into the page the sink reserved for it (``recvmsg_into``
across the batch's pages) and handed to :class:`~kvtier.p2p.installs.PendingInstalls`, which
verifies it against the header's page tag and only then commits it (I6). A key the sink holds
by the time its block comes has its payload dropped and counts as found meanwhile; a key the
sink cannot take (no page to free) ends the usable prefix and the exchange (closing beats
draining). What happened accumulates in a :class:`FetchProgress`, which the client turns into
its :class:`~kvtier.p2p.client.FetchResult`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.errors import P2PError, ProtocolError
from kvtier.keys import OffloadKey
from kvtier.p2p.channel import FrameChannel, PeerClosed, UnverifiedPayload
from kvtier.p2p.frames import BlockBatch, Fail, KvRequestId
from kvtier.p2p.installs import PendingInstalls, Received
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.sink import ALREADY_HELD, BlockSink, PageReservation


@dataclass(slots=True)
class FetchProgress:
    """What one fetch achieved so far (one per :meth:`P2PClient.fetch`)."""

    fetched: list[OffloadKey] = field(default_factory=list)
    found_meanwhile: list[OffloadKey] = field(default_factory=list)
    nbytes: int = 0
    reason: str | None = None
    session_clean: bool = True
    frames: int = 0

    @property
    def untouched(self) -> bool:
        """Nothing was received yet (a retry on a fresh session is safe)."""
        return self.frames == 0

    def installed(self, keys: list[OffloadKey], nbytes: int) -> None:
        self.fetched.extend(keys)
        self.nbytes += nbytes


class BlockReceiver:
    """Receives the blocks of fetches into one sink; one per client."""

    def __init__(
        self,
        fingerprint: LayoutFingerprint,
        sink: BlockSink,
        verifier: concurrent.futures.Executor | None,
    ) -> None:
        """``verifier``: where payloads are verified (None: on the loop, as they land)."""
        self._fingerprint = fingerprint
        self._sink = sink
        self._verifier = verifier

    async def receive(
        self,
        channel: FrameChannel,
        rid: KvRequestId,
        missing: tuple[OffloadKey, ...],
        progress: FetchProgress,
    ) -> None:
        """Take the producer's answer to a ``fetch`` of ``missing`` (sent by the caller)."""
        installs = PendingInstalls(self._verifier, self._sink, progress.installed)
        try:
            await self._receive_blocks(channel, rid, missing, progress, installs)
            await installs.finish()  # IntegrityError: the prefix ends at the page that failed
        except (P2PError, OSError, TimeoutError) as exc:
            installs.settle()  # installs what was received whole and verifies
            if installs.failure is not None and installs.failure is not exc:
                raise installs.failure from exc  # a forged page says more than what followed
            raise
        finally:
            installs.settle()  # nothing left on success; on cancellation, as above

    async def _receive_blocks(
        self,
        channel: FrameChannel,
        rid: KvRequestId,
        missing: tuple[OffloadKey, ...],
        progress: FetchProgress,
        installs: PendingInstalls,
    ) -> None:
        i = 0
        while i < len(missing):
            frame = await channel.read_frame()
            if frame is None:
                raise PeerClosed("producer closed the connection during a fetch")
            progress.frames += 1
            if isinstance(frame, Fail):
                named = missing[i : i + len(frame.keys)]
                if frame.kv_request_id != rid or not frame.keys or frame.keys != named:
                    raise ProtocolError("fail frame names keys out of order")
                if progress.reason is None:
                    progress.reason = f"producer: {frame.reason}"
                i += len(frame.keys)
                continue
            if not isinstance(frame, BlockBatch):
                raise ProtocolError(f"unexpected {type(frame).__name__} frame during a fetch")
            self._check_batch(frame, missing[i : i + len(frame.blocks)])
            if not await self._receive_batch(channel, frame, progress, installs):
                return
            i += len(frame.blocks)

    def _check_batch(self, batch: BlockBatch, expected: tuple[OffloadKey, ...]) -> None:
        """The batch names exactly the next demanded keys, each with its layout's size."""
        if tuple(block.key for block in batch.blocks) != expected:
            raise ProtocolError("blocks for keys out of order or not demanded")
        fingerprint = self._fingerprint
        for block in batch.blocks:
            if block.nbytes != fingerprint.page_nbytes(block.key):
                raise ProtocolError(f"block of {block.nbytes} bytes; the layout says otherwise")

    async def _receive_batch(
        self,
        channel: FrameChannel,
        batch: BlockBatch,
        progress: FetchProgress,
        installs: PendingInstalls,
    ) -> bool:
        """Reserve a page for each block of ``batch`` the sink lacks and receive the payloads
        into them (the rest are read and dropped); False when the fetch must stop reading."""
        reservations: list[PageReservation | None] = []
        try:
            for block in batch.blocks:
                if progress.reason is not None:
                    reservations.append(None)  # past the end of the prefix
                    continue
                reservation = self._sink.reserve(block.key, block.nbytes)
                if reservation is ALREADY_HELD:
                    progress.found_meanwhile.append(block.key)  # its bytes are already local
                    reservations.append(None)
                elif reservation is None:
                    progress.reason = "no free host page for a fetched block"
                    progress.session_clean = False  # stop reading: closing beats draining
                    return False
                else:
                    reservations.append(reservation)

            def landed(pages: Sequence[tuple[int, UnverifiedPayload]]) -> None:
                received = []
                for j, payload in pages:
                    reservation, reservations[j] = reservations[j], None
                    if reservation is not None:  # ours from here on: installs commits or aborts
                        received.append(Received(batch.blocks[j].key, reservation, payload))
                installs.add(received)

            dests = [None if r is None else r.buffer for r in reservations]
            await channel.receive_blocks_into(dests, landed)
            installs.commit_verified()  # the batch's pages that were verified as they landed
            return True
        finally:
            for reservation in reservations:  # not handed to installs: never readable
                if reservation is not None:
                    reservation.abort()

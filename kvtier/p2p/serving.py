"""Producer side: one authenticated session, served (a reader and a sender per connection).

:class:`SessionServer` runs a connection after :class:`~kvtier.p2p.server.P2PServer` has
authenticated the peer. Its reader accepts ``fetch`` (queued, at most a few per connection),
``done``/``release`` (the supply is released) and ``offer`` (answered while the sender is idle,
so frames stay in order); its sender serves the queued fetches in order, each key as soon as it
is readable, together with the keys after it that are readable too (one ``blocks`` frame and
one ``sendmsg`` for up to 8 MiB of pages). A key that cannot be served ends the fetch with one
``fail`` frame naming it and every later key (the consumer's usable prefix ends there anyway).
Every wait is bounded: the idle session (``idle_session_s``), the demand per key
(``demand_wait_s`` while the producer runs; none once it finished) and one fetch as a whole
(``max_fetch_s``, which also cuts off a consumer that stops reading). Errors propagate to the
server, which counts and logs them and closes the session.
"""

from __future__ import annotations

import asyncio
import logging

from kvtier.errors import ProtocolError
from kvtier.keys import OffloadKey
from kvtier.p2p.channel import FrameChannel
from kvtier.p2p.frames import (
    MAX_BLOCKS_PER_FRAME,
    MAX_REASON_CHARS,
    Done,
    Fail,
    Fetch,
    Frame,
    KvRequestId,
    Offer,
    Release,
)
from kvtier.p2p.handshake import PeerInfo
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.offer import OfferDesk, OfferLedger
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.supply import SendHold, SupplyRegistry

logger = logging.getLogger(__name__)

_MAX_QUEUED_FETCHES = 16
_BATCH_BYTES = 8 << 20
"""A ``blocks`` frame stops growing at this many payload bytes (or MAX_BLOCKS_PER_FRAME)."""
_SEND_GRACE_S = 1.0


class SessionServer:
    """Serves the fetches and offers of authenticated peers (one instance per server)."""

    def __init__(
        self,
        settings: P2PSettings,
        fingerprint: LayoutFingerprint,
        registry: SupplyRegistry,
        offers: OfferDesk | None,
    ) -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.registry = registry
        self.offers = offers

    async def run(self, channel: FrameChannel, peer: PeerInfo, owned: set[KvRequestId]) -> None:
        """Serve ``peer`` until it closes, goes idle or breaks the protocol (raises why);
        ``owned`` collects the kv_request_ids it fetched (the caller releases them)."""
        queue: asyncio.Queue[Fetch] = asyncio.Queue(_MAX_QUEUED_FETCHES)
        busy = asyncio.Event()
        ledger = OfferLedger()
        sender = asyncio.create_task(self._send_loop(channel, queue, busy))
        read: asyncio.Task[Frame | None] | None = None
        try:
            while True:
                read = asyncio.create_task(channel.read_frame())
                while True:
                    done, _ = await asyncio.wait(
                        {read, sender},
                        timeout=self.settings.idle_session_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if done:
                        break
                    if not busy.is_set() and queue.empty():
                        raise TimeoutError  # idle session
                if sender in done:
                    sender.result()  # re-raises why the sender stopped
                    return
                frame = read.result()
                read = None
                if frame is None:
                    return
                if isinstance(frame, Fetch):
                    if len(frame.keys) > self.settings.max_keys_per_fetch:
                        raise ProtocolError(f"fetch of {len(frame.keys)} keys exceeds the limit")
                    for key in frame.keys:  # groups the layout lacks: refuse before serving
                        self.fingerprint.page_nbytes(key)
                    if queue.full():
                        raise ProtocolError("too many fetches queued on one connection")
                    owned.add(frame.kv_request_id)
                    queue.put_nowait(frame)
                elif isinstance(frame, Done | Release):
                    owned.discard(frame.kv_request_id)
                    reason = "done" if isinstance(frame, Done) else f"release from {peer.node_id}"
                    self.registry.release(frame.kv_request_id, reason)
                elif isinstance(frame, Offer):
                    await self._answer_offer(
                        channel, frame, ledger, busy.is_set() or not queue.empty()
                    )
                else:
                    raise ProtocolError(f"unexpected {type(frame).__name__} frame from a consumer")
        finally:
            tasks = [t for t in (read, sender) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send_loop(
        self, channel: FrameChannel, queue: asyncio.Queue[Fetch], busy: asyncio.Event
    ) -> None:
        while True:
            fetch = await queue.get()
            busy.set()
            # Bounds a consumer that stops reading, too: the send cannot outlive the fetch.
            limit = min(fetch.deadline_ms / 1000, self.settings.max_fetch_s) + _SEND_GRACE_S
            try:
                async with asyncio.timeout(limit):
                    await self._serve(channel, fetch)
            finally:
                busy.clear()

    async def _serve(self, channel: FrameChannel, fetch: Fetch) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + fetch.deadline_ms / 1000
        unknown_until = start + self.settings.unknown_request_wait_s
        keys = fetch.keys
        i = 0
        while i < len(keys):
            until = min(deadline, loop.time() + self.settings.demand_wait_s)
            hold = await self.registry.acquire(fetch.kv_request_id, keys[i], until, unknown_until)
            if isinstance(hold, str):
                await self._fail(channel, fetch, keys[i:], hold)
                return
            holds = [hold]
            try:
                self._add_readable(fetch, i, holds)
                bad = self._misfit(keys[i : i + len(holds)], holds)
                if bad > 0:
                    sendable = [(keys[i + j], holds[j].view, holds[j].tag) for j in range(bad)]
                    await channel.send_blocks(sendable)
                if bad < len(holds):
                    reason = f"supplied page has {len(holds[bad].view)} bytes; the layout differs"
                    await self._fail(channel, fetch, keys[i + bad :], reason)
                    return
            finally:
                for held in holds:
                    held.close()
            i += len(holds)

    def _add_readable(self, fetch: Fetch, i: int, holds: list[SendHold]) -> None:
        """Extend ``holds`` (the held page of ``fetch.keys[i]``) with the next keys' pages that
        are readable now, up to one frame's worth: one header and one ``sendmsg`` for them."""
        nbytes = len(holds[0].view)
        for key in fetch.keys[i + 1 : i + MAX_BLOCKS_PER_FRAME]:
            if nbytes >= _BATCH_BYTES:
                return
            hold = self.registry.acquire_readable(fetch.kv_request_id, key)
            if hold is None:
                return
            holds.append(hold)
            nbytes += len(hold.view)

    def _misfit(self, keys: tuple[OffloadKey, ...], holds: list[SendHold]) -> int:
        """Index of the first hold whose page size is not its key's layout size (or len)."""
        fingerprint = self.fingerprint
        for j, (key, hold) in enumerate(zip(keys, holds, strict=True)):
            if len(hold.view) != fingerprint.page_nbytes(key):
                return j
        return len(holds)

    async def _answer_offer(
        self, channel: FrameChannel, offer: Offer, ledger: OfferLedger, fetching: bool
    ) -> None:
        # Answered by the reader while the sender is idle (checked), so frames stay in order.
        if self.offers is None:
            raise ProtocolError("this node answers no offers")
        self.offers.check(offer, ledger, fetch_in_flight=fetching)
        for key in offer.keys:  # groups the layout lacks: refuse, as for a fetch
            self.fingerprint.page_nbytes(key)
        await channel.send_frame(await self.offers.answer(offer, ledger))

    async def _fail(
        self, channel: FrameChannel, fetch: Fetch, keys: tuple[OffloadKey, ...], reason: str
    ) -> None:
        logger.info(
            "p2p fetch %s: failing %d of %d keys: %s",
            fetch.kv_request_id,
            len(keys),
            len(fetch.keys),
            reason,
        )
        await channel.send_frame(Fail(fetch.kv_request_id, keys, reason[:MAX_REASON_CHARS]))

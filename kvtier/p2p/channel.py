"""Framed I/O over one non-blocking TCP socket, with zero-copy payloads and MACs.

Control frames are read exactly (prefix, then body) so no payload byte is ever buffered here.
A batch's payloads go straight from the socket into the caller's destination pages with
``recvmsg_into`` (one call fills the pages of about :data:`IO_CHUNK_BYTES` that the socket
holds; ``loop.sock_recv_into`` waits when it holds none) and from page memory to the socket with
``sendmsg`` of the header and the payloads, about :data:`IO_CHUNK_BYTES` per call
(``loop.sock_sendall`` when the socket is full). One header per batch
rather than per page saves the per-page frame, seal, parse and syscalls that dominated the
consumer's event loop. ``StreamReader.readexactly`` copies every chunk and measured 5-10x
slower on large buffers, so it is not used.

A channel starts *unsealed*: it carries only handshake frames, each at most
:data:`~kvtier.p2p.frames.HANDSHAKE_MAX_FRAME_BYTES`, so an unauthenticated peer can make it
allocate a few KiB at most. After the handshake :meth:`FrameChannel.seal` installs the session
keys (and the page key: the producer's :class:`~kvtier.p2p.sealing.PageSealer`, the consumer's
:class:`~kvtier.p2p.sealing.PageOpener`); from then on every frame carries a MAC under the
session key that is verified before its body is parsed, each block payload is verified against
the page tag in its (session-MACed) ``blocks`` header after it landed in the destination page
and before the caller may use it, and handshake frames are refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ProtocolError
from kvtier.keys import OffloadKey
from kvtier.p2p.frames import (
    HANDSHAKE_FRAMES,
    HANDSHAKE_MAX_FRAME_BYTES,
    LENGTH_PREFIX,
    MAX_BLOCKS_PER_FRAME,
    BlockBatch,
    BlockHeader,
    Frame,
    decode_frame,
    encode_body,
    encode_frame,
    frame_length,
)
from kvtier.p2p.sealing import TAG_BYTES, Opener, PageOpener, PageSealer, PageTag, Sealer

_IOV_MAX = 512
"""Buffers per ``sendmsg``/``recvmsg_into`` call (Linux allows 1024)."""
IO_CHUNK_BYTES = 512 << 10
"""About how many bytes one ``sendmsg``/``recvmsg_into`` offers the kernel (buffers are added
until they hold this much; at least one). Why not the whole batch: a receive that may drain the
socket buffer at once (up to 8 MiB) and a send of a whole batch make the two ends take turns
instead of overlapping. Two blocking threads moving 256 MiB in 512 KiB pages over loopback on 2
cores, 25 paired runs: 0.71-0.72x the raw benchmark's speed when each call could move it all,
0.90-0.92x at about one page per call (``loadtest/bench_p2p`` has the P2P figures)."""
_DISCARD_CHUNK = 1 << 20

OutgoingBlock = tuple[OffloadKey, memoryview, PageTag | None]
"""A block to send: its key, its payload (page memory) and its cached tag (None: tag it now)."""


class PeerClosed(ProtocolError):
    """The peer closed the connection (cleanly between frames, or in the middle of one)."""


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """Non-blocking, no Nagle delay, and larger kernel buffers for page-sized payloads."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def is_loopback(address: object) -> bool:
    """True for a peer address (``getpeername()``) on the loopback interface."""
    if not isinstance(address, tuple) or not address:
        return False
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


@dataclass(frozen=True, slots=True)
class UnverifiedPayload:
    """A block payload received into its destination, not yet checked against its tag."""

    opener: PageOpener
    dest: memoryview
    tag: PageTag

    def verify(self) -> None:
        """IntegrityError unless ``dest`` holds the bytes the producer tagged (any thread)."""
        self.opener.verify(self.dest, self.tag, "block payload")


class FrameChannel:
    """One connection's frames and payloads. Not safe for concurrent readers or writers."""

    __slots__ = (
        "_closed",
        "_loop",
        "_max_frame",
        "_opener",
        "_page_opener",
        "_page_sealer",
        "_pending",
        "_prefix",
        "_sealer",
        "peer",
        "sock",
    )

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._max_frame = max_frame_bytes
        self._prefix = bytearray(LENGTH_PREFIX.size)
        self._closed = False
        self._sealer: Sealer | None = None
        self._opener: Opener | None = None
        self._page_sealer: PageSealer | None = None
        self._page_opener: PageOpener | None = None
        self._pending: BlockBatch | None = None
        try:
            self.peer: object = sock.getpeername()
        except OSError:
            self.peer = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def sealed(self) -> bool:
        return self._opener is not None

    def seal(
        self,
        send_key: bytes,
        recv_key: bytes,
        *,
        page_sealer: PageSealer | None = None,
        page_opener: PageOpener | None = None,
    ) -> None:
        """The handshake succeeded: authenticate everything from here on, both ways. The
        producer's end gets the page sealer (to tag pages sent without a cached tag), the
        consumer's the page opener (to verify every payload it receives)."""
        self._sealer = Sealer(send_key)
        self._opener = Opener(recv_key)
        self._page_sealer = page_sealer
        self._page_opener = page_opener

    async def _recv_exactly(self, view: memoryview) -> int:
        """Fill ``view``; returns bytes read (less than its length only at EOF)."""
        got = 0
        total = len(view)
        recv_into = self._loop.sock_recv_into
        while got < total:
            try:
                n = await recv_into(self.sock, view[got:])
            except OSError as exc:
                raise PeerClosed(f"connection lost: {exc}") from exc
            if n == 0:
                return got
            got += n
        return got

    async def read_frame(self) -> Frame | None:
        """The next control frame, or None when the peer closed cleanly between frames.

        Sealed: the frame's MAC is verified before its body is parsed (IntegrityError); after
        a ``blocks`` header the caller must take its payloads (:meth:`receive_blocks_into`)
        before the next frame.
        """
        if self._pending is not None:
            raise ProtocolError("the previous blocks' payloads were not read")
        prefix = memoryview(self._prefix)
        got = await self._recv_exactly(prefix)
        if got == 0:
            return None
        if got < len(prefix):
            raise PeerClosed("connection closed inside a frame length prefix")
        opener = self._opener
        if opener is None:
            n = frame_length(prefix, min(self._max_frame, HANDSHAKE_MAX_FRAME_BYTES))
        else:
            n = frame_length(prefix, self._max_frame + TAG_BYTES)
            if n <= TAG_BYTES:
                raise ProtocolError(f"sealed frame of {n} bytes has no body")
        data = bytearray(n)
        if await self._recv_exactly(memoryview(data)) < n:
            raise PeerClosed(f"connection closed inside a {n}-byte frame")
        if opener is None:
            frame = decode_frame(data)
            if not isinstance(frame, HANDSHAKE_FRAMES):
                raise ProtocolError(f"{type(frame).__name__} frame before authentication")
            return frame
        body = memoryview(data)[: n - TAG_BYTES]
        opener.verify(bytes(self._prefix) + body, memoryview(data)[n - TAG_BYTES :], "frame")
        frame = decode_frame(body)
        if isinstance(frame, HANDSHAKE_FRAMES):
            raise ProtocolError(f"{type(frame).__name__} frame after authentication")
        if isinstance(frame, BlockBatch):
            self._pending = frame
        return frame

    async def receive_blocks_into(
        self,
        dests: Sequence[memoryview | None],
        landed: Callable[[list[tuple[int, UnverifiedPayload]]], None],
    ) -> None:
        """Receive the announced batch's payloads straight into ``dests`` (one per block, each
        exactly its size; None: read and drop that payload), without verifying them.

        ``landed([(i, payload), ...])`` is called once per receive that completed pages, with
        each block ``i`` whose payload is now whole in ``dests[i]``, in order; nobody may use
        one before :meth:`UnverifiedPayload.verify` returned (the client verifies them on a
        worker thread, or right in ``landed``: :mod:`kvtier.p2p.installs`). Each
        ``recvmsg_into`` fills what the socket holds, up to about 512 KiB of pages (a
        :data:`IO_CHUNK_BYTES` window); the loop is entered only when
        it holds none.
        """
        batch = self._pending
        if batch is None:
            raise ProtocolError("no blocks header announced these payloads")
        if len(dests) != len(batch.blocks) or any(
            d is not None and len(d) != b.nbytes for b, d in zip(batch.blocks, dests, strict=True)
        ):
            raise ProtocolError("payload destinations do not match the announced blocks")
        self._pending = None
        page_opener = self._page_opener
        if page_opener is None:
            raise ProtocolError("no page key: this end does not receive blocks")
        segments, ends = _segments(batch, dests)
        total = ends[-1]
        got = seg = whole = 0
        while got < total:
            window = segments[seg : _chunk_end(segments, seg)]
            try:
                n = self.sock.recvmsg_into(window)[0]
            except (BlockingIOError, InterruptedError):
                # Nothing buffered: wait on the loop, reading into the current segment.
                try:
                    n = await self._loop.sock_recv_into(self.sock, window[0])
                except OSError as exc:
                    raise PeerClosed(f"connection lost: {exc}") from exc
            except OSError as exc:
                raise PeerClosed(f"connection lost: {exc}") from exc
            if n == 0:
                raise PeerClosed(f"connection closed inside {total} bytes of payloads")
            got += n
            while n > 0:
                if n >= len(segments[seg]):
                    n -= len(segments[seg])
                    seg += 1
                else:
                    segments[seg] = segments[seg][n:]
                    n = 0
            if ends[whole] > got:
                continue
            completed = []
            while whole < len(ends) and ends[whole] <= got:
                dest = dests[whole]
                if dest is not None:
                    block = batch.blocks[whole]
                    tag = PageTag(block.nonce, block.mac)
                    completed.append((whole, UnverifiedPayload(page_opener, dest, tag)))
                whole += 1
            if completed:
                landed(completed)

    async def send_frame(self, frame: Frame) -> None:
        sealer = self._sealer
        if sealer is None:
            if not isinstance(frame, HANDSHAKE_FRAMES):
                raise ProtocolError(f"{type(frame).__name__} frame before authentication")
            await self._send(encode_frame(frame))
            return
        await self._send(self._sealed(sealer, sealer.reserve(), encode_body(frame)))

    @staticmethod
    def _sealed(sealer: Sealer, seq: int, body: bytes) -> bytes:
        head = LENGTH_PREFIX.pack(len(body) + TAG_BYTES) + body
        return head + sealer.tag(seq, head)

    async def send_blocks(self, blocks: Sequence[OutgoingBlock]) -> None:
        """One ``blocks`` header and its payloads, each sent from its page's memory.

        A block without a tag is tagged now by the page sealer; a cached tag (computed once
        when the page was supplied) is sent as is. The tags travel in the session-MACed header.
        ``sendmsg`` writes header and payloads together (scatter, no copy in Python); when the
        socket is full the rest follows as it drains.
        """
        sealer = self._sealer
        if sealer is None:
            raise ProtocolError("block before authentication")
        if not 0 < len(blocks) <= MAX_BLOCKS_PER_FRAME:
            raise ValueError(f"a blocks frame carries 1..{MAX_BLOCKS_PER_FRAME} blocks")
        headers = []
        for key, payload, cached in blocks:
            tag = cached
            if tag is None:
                if self._page_sealer is None:
                    raise ProtocolError("no page key: this end does not send blocks")
                tag = self._page_sealer.tag(payload)
            headers.append(BlockHeader(key, len(payload), tag.mac, tag.nonce))
        head = self._sealed(sealer, sealer.reserve(), encode_body(BlockBatch(tuple(headers))))
        await self._send_all([memoryview(head), *(payload for _, payload, _ in blocks)])

    async def _send_all(self, buffers: list[memoryview]) -> None:
        """Write ``buffers`` in order: ``sendmsg`` while the socket takes them, the loop's
        ``sock_sendall`` for the current buffer when it is full."""
        i = 0
        while i < len(buffers):
            try:
                sent = self.sock.sendmsg(buffers[i : _chunk_end(buffers, i)])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise PeerClosed(f"connection lost while sending: {exc}") from exc
            while sent > 0:
                if sent >= len(buffers[i]):
                    sent -= len(buffers[i])
                    i += 1
                else:
                    buffers[i] = buffers[i][sent:]
                    sent = 0
            if i < len(buffers):
                await self._send(buffers[i])  # waits until the socket drains
                i += 1

    async def _send(self, data: bytes | memoryview) -> None:
        try:
            await self._loop.sock_sendall(self.sock, data)
        except OSError as exc:
            raise PeerClosed(f"connection lost while sending: {exc}") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()


def _chunk_end(buffers: list[memoryview], start: int) -> int:
    """End of the run of ``buffers`` from ``start`` that one I/O call moves: buffers until they
    hold :data:`IO_CHUNK_BYTES` (a small header goes with the page after it), at most
    :data:`_IOV_MAX`."""
    end = start
    budget = IO_CHUNK_BYTES
    limit = min(len(buffers), start + _IOV_MAX)
    while end < limit and budget > 0:
        budget -= len(buffers[end])
        end += 1
    return end


def _segments(
    batch: BlockBatch, dests: Sequence[memoryview | None]
) -> tuple[list[memoryview], list[int]]:
    """The receive buffers of a batch (a dropped payload goes to one bounded scratch buffer,
    reused) and the offset at which each block's payload ends."""
    segments: list[memoryview] = []
    ends: list[int] = []
    scratch: memoryview | None = None
    offset = 0
    for block, dest in zip(batch.blocks, dests, strict=True):
        if dest is not None:
            segments.append(dest)
        else:
            if scratch is None:
                scratch = memoryview(bytearray(_DISCARD_CHUNK))
            left = block.nbytes
            while left > 0:
                segments.append(scratch[: min(left, _DISCARD_CHUNK)])
                left -= _DISCARD_CHUNK
        offset += block.nbytes
        ends.append(offset)
    return segments, ends

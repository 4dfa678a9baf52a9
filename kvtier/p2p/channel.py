"""Framed I/O over one non-blocking TCP socket, with zero-copy payloads and MACs.

Control frames are read exactly (prefix, then body) so no payload byte is ever buffered here;
payloads go straight from the socket into the caller's destination buffer with
``loop.sock_recv_into`` and from page memory to the socket with ``loop.sock_sendall`` on a
memoryview. ``StreamReader.readexactly`` copies every chunk and measured 5-10x slower on large
buffers, so it is not used.

A channel starts *unsealed*: it carries only handshake frames, each at most
:data:`~kvtier.p2p.frames.HANDSHAKE_MAX_FRAME_BYTES`, so an unauthenticated peer can make it
allocate a few KiB at most. After the handshake :meth:`FrameChannel.seal` installs the session
keys (and the page key: the producer's :class:`~kvtier.p2p.sealing.PageSealer`, the consumer's
:class:`~kvtier.p2p.sealing.PageOpener`); from then on every frame carries a MAC under the
session key that is verified before its body is parsed, each block payload is verified against
the page tag in its (session-MACed) header after it landed in the destination page and before
the caller may use it, and handshake frames are refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

from kvtier.errors import ProtocolError
from kvtier.keys import OffloadKey
from kvtier.p2p.frames import (
    HANDSHAKE_FRAMES,
    HANDSHAKE_MAX_FRAME_BYTES,
    LENGTH_PREFIX,
    BlockHeader,
    Frame,
    decode_frame,
    encode_body,
    encode_frame,
    frame_length,
)
from kvtier.p2p.sealing import TAG_BYTES, Opener, PageOpener, PageSealer, PageTag, Sealer


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
        self._pending: BlockHeader | None = None
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
        a ``block`` header the caller must take its payload (:meth:`read_payload_into` or
        :meth:`discard_payload`) before the next frame.
        """
        if self._pending is not None:
            raise ProtocolError("the previous block's payload was not read")
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
        if isinstance(frame, BlockHeader):
            self._pending = frame
        return frame

    def _take_pending(self, nbytes: int) -> BlockHeader:
        header = self._pending
        if header is None:
            raise ProtocolError("no block header announced this payload")
        if header.nbytes != nbytes:
            raise ProtocolError(f"payload of {header.nbytes} bytes read as {nbytes}")
        self._pending = None
        return header

    async def read_payload_into(self, dest: memoryview) -> None:
        """Receive the announced payload straight into ``dest`` (exactly its size), then verify
        it against the header's page tag; IntegrityError means ``dest`` holds bytes nobody may
        use."""
        (await self.receive_payload_into(dest)).verify()

    async def receive_payload_into(self, dest: memoryview) -> UnverifiedPayload:
        """Receive the announced payload straight into ``dest`` (exactly its size), without
        verifying it: nobody may use ``dest`` before the answer's :meth:`~UnverifiedPayload.
        verify` returned (the client runs it on a worker thread, overlapping the next receive).
        """
        header = self._take_pending(len(dest))
        page_opener = self._page_opener
        if page_opener is None:
            raise ProtocolError("no page key: this end does not receive blocks")
        got = 0
        total = len(dest)
        recv_into = self._loop.sock_recv_into
        while got < total:
            try:
                n = await recv_into(self.sock, dest[got:])
            except OSError as exc:
                raise PeerClosed(f"connection lost: {exc}") from exc
            if n == 0:
                raise PeerClosed(f"connection closed inside a {total}-byte payload")
            got += n
        return UnverifiedPayload(page_opener, dest, PageTag(header.nonce, header.mac))

    async def discard_payload(self, nbytes: int) -> None:
        """Read and drop the announced payload (the receiver cannot use it), in bounded chunks.
        Its tag is not checked: nothing of it is kept."""
        self._take_pending(nbytes)
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        left = nbytes
        while left > 0:
            step = scratch[: min(left, len(scratch))]
            if await self._recv_exactly(step) < len(step):
                raise PeerClosed("connection closed inside a discarded payload")
            left -= len(step)

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

    async def send_block(
        self, key: OffloadKey, payload: memoryview, tag: PageTag | None = None
    ) -> None:
        """A block header and its payload, the payload sent from ``payload``'s memory.

        ``tag``: the payload's page tag, computed once when the page was supplied; without one
        the page sealer tags the payload now. The tag travels in the session-MACed header. One
        ``sendmsg`` tries both at once (one syscall per block when the socket has room);
        whatever did not fit goes out with ``sock_sendall``.
        """
        sealer = self._sealer
        if sealer is None:
            raise ProtocolError("block before authentication")
        if tag is None:
            if self._page_sealer is None:
                raise ProtocolError("no page key: this end does not send blocks")
            tag = self._page_sealer.tag(payload)
        header = BlockHeader(key, len(payload), tag.mac, tag.nonce)
        head = self._sealed(sealer, sealer.reserve(), encode_body(header))
        try:
            sent = self.sock.sendmsg((head, payload))
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            raise PeerClosed(f"connection lost while sending: {exc}") from exc
        if sent < len(head):
            await self._send(memoryview(head)[sent:])
            sent = len(head)
        if sent - len(head) < len(payload):
            await self._send(payload[sent - len(head) :])

    async def _send(self, data: bytes | memoryview) -> None:
        try:
            await self._loop.sock_sendall(self.sock, data)
        except OSError as exc:
            raise PeerClosed(f"connection lost while sending: {exc}") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()

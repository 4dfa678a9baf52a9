"""Framed I/O over one non-blocking TCP socket, with zero-copy payloads.

Control frames are read exactly (prefix, then body) so no payload byte is ever buffered here;
payloads go straight from the socket into the caller's destination buffer with
``loop.sock_recv_into`` and from page memory to the socket with ``loop.sock_sendall`` on a
memoryview. ``StreamReader.readexactly`` copies every chunk and measured 5-10x slower on large
buffers, so it is not used.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import xxhash

from kvtier.errors import ProtocolError
from kvtier.p2p.frames import (
    LENGTH_PREFIX,
    BlockHeader,
    Frame,
    decode_frame,
    encode_frame,
    frame_length,
)


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


class FrameChannel:
    """One connection's frames and payloads. Not safe for concurrent readers or writers."""

    __slots__ = ("_closed", "_loop", "_max_frame", "_prefix", "peer", "sock")

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._max_frame = max_frame_bytes
        self._prefix = bytearray(LENGTH_PREFIX.size)
        self._closed = False
        try:
            self.peer: object = sock.getpeername()
        except OSError:
            self.peer = None

    @property
    def closed(self) -> bool:
        return self._closed

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
        """The next control frame, or None when the peer closed cleanly between frames."""
        prefix = memoryview(self._prefix)
        got = await self._recv_exactly(prefix)
        if got == 0:
            return None
        if got < len(prefix):
            raise PeerClosed("connection closed inside a frame length prefix")
        n = frame_length(prefix, self._max_frame)
        body = bytearray(n)
        if await self._recv_exactly(memoryview(body)) < n:
            raise PeerClosed(f"connection closed inside a {n}-byte frame")
        return decode_frame(body)

    async def read_payload_into(self, dest: memoryview) -> int:
        """Receive exactly ``len(dest)`` payload bytes straight into ``dest``.

        Returns the xxh3-64 of the payload, hashed chunk by chunk as it arrives (while the bytes
        are still in cache) rather than in a second pass over the page.
        """
        hasher = xxhash.xxh3_64()
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
            hasher.update(dest[got : got + n])
            got += n
        return hasher.intdigest()

    async def discard_payload(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (a payload the receiver cannot use), in bounded chunks."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        left = nbytes
        while left > 0:
            step = scratch[: min(left, len(scratch))]
            if await self._recv_exactly(step) < len(step):
                raise PeerClosed("connection closed inside a discarded payload")
            left -= len(step)

    async def send_frame(self, frame: Frame) -> None:
        await self._send(encode_frame(frame))

    async def send_block(self, header: BlockHeader, payload: memoryview) -> None:
        """A block header and its payload, the payload sent from ``payload``'s memory.

        One ``sendmsg`` tries both at once (one syscall per block when the socket has room);
        whatever did not fit goes out with ``sock_sendall``.
        """
        head = encode_frame(header)
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

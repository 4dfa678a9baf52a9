"""An on-path attacker for P2P tests: a relay that the consumer was made to connect to.

It does what issue 15's relay attack did: it forwards the consumer's handshake to the real
producer and the producer's answers back, byte for byte, so both ends authenticate each other
through it. Then it tampers with the producer → consumer stream according to ``mode``:

- ``forge``: keeps every ``blocks`` header, replaces every payload with bytes of its choosing;
- ``flip``: flips one bit in the middle of the first payload (a corrupting network);
- ``inject``: replaces the first ``blocks`` frame with one it made up (header, MACs, frame tag,
  payloads);
- ``replay``: (consumer → producer) sends every ``fetch`` frame twice;
- ``relay``: changes nothing (the control: a relay on its own harms nobody).

It knows the frame layout (it is public) and reads every plaintext body, but not the shared
secret. Used by tests/kvtier/p2p (in-process pair) and tests/reliability (real workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from typing import Literal

import msgpack

from kvtier.p2p.frames import BlockBatch, BlockHeader, encode_body
from kvtier.p2p.sealing import TAG_BYTES

Mode = Literal["forge", "flip", "inject", "replay", "relay"]
_PREFIX = struct.Struct(">I")


class RelayAttacker:
    """``127.0.0.1:port`` → ``127.0.0.1:target_port``, tampering as ``mode`` says."""

    def __init__(self, target_port: int, mode: Mode) -> None:
        self.target_port = target_port
        self.mode = mode
        self.port = 0
        self.handshakes_relayed = 0
        self.payloads_tampered = 0
        self.frames_replayed = 0
        self.blocks_seen = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> RelayAttacker:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        # Aborted transports end the handlers by themselves; a handler cancelled from outside
        # would make asyncio log its CancelledError.
        if self._tasks:
            _, stuck = await asyncio.wait(set(self._tasks), timeout=5)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(OSError):
                await self._server.wait_closed()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.append(c_writer)
        try:
            p_reader, p_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.append(p_writer)
            up = asyncio.create_task(self._consumer_to_producer(c_reader, p_writer))
            down = asyncio.create_task(self._producer_to_consumer(p_reader, c_writer))
            try:
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (up, down):
                    t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
                p_writer.transport.abort()
        except OSError:
            pass
        finally:
            c_writer.transport.abort()
            self._tasks.discard(task)

    async def _consumer_to_producer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, OSError):
            writer.write(await _plain_frame(reader))  # auth
            await writer.drain()
            while True:
                prefix = await reader.readexactly(_PREFIX.size)
                (n,) = _PREFIX.unpack(prefix)
                data = prefix + await reader.readexactly(n)
                writer.write(data)
                if self.mode == "replay" and _body(data).get("type") == "fetch":
                    writer.write(data)  # the same sealed fetch again, verbatim
                    self.frames_replayed += 1
                await writer.drain()

    async def _producer_to_consumer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, OSError):
            for _ in range(2):  # hello, then welcome (or refuse)
                writer.write(await _plain_frame(reader))
                await writer.drain()
            self.handshakes_relayed += 1
            while True:
                prefix = await reader.readexactly(_PREFIX.size)
                (n,) = _PREFIX.unpack(prefix)
                frame = prefix + await reader.readexactly(n)
                body = _body(frame)
                if body.get("type") != "blocks":
                    writer.write(frame)
                    await writer.drain()
                    continue
                entries = body["blocks"]
                assert isinstance(entries, list)
                payloads = [bytearray(await reader.readexactly(int(e[1]))) for e in entries]
                first = self.blocks_seen == 0
                self.blocks_seen += len(entries)
                frame, payloads = self._tamper(frame, entries, payloads, first)
                writer.write(frame)
                for data in payloads:
                    writer.write(data)
                await writer.drain()

    def _tamper(
        self, frame: bytes, entries: list[list[object]], payloads: list[bytearray], first: bool
    ) -> tuple[bytes, list[bytearray]]:
        if self.mode == "forge":
            self.payloads_tampered += len(payloads)
            return frame, [bytearray(b"\x42" * len(p)) for p in payloads]
        if self.mode == "flip" and first:
            self.payloads_tampered += 1
            payloads[0][len(payloads[0]) // 2] ^= 0x01
            return frame, payloads
        if self.mode == "inject" and first:
            self.payloads_tampered += len(payloads)
            forged = [bytearray(b"\x66" * len(p)) for p in payloads]
            blocks = tuple(
                BlockHeader(e[0], len(f), os.urandom(16))  # type: ignore[arg-type]
                for e, f in zip(entries, forged, strict=True)
            )
            packed = encode_body(BlockBatch(blocks))
            head = _PREFIX.pack(len(packed) + TAG_BYTES) + packed
            return head + os.urandom(TAG_BYTES), forged
        return frame, payloads


async def _plain_frame(reader: asyncio.StreamReader) -> bytes:
    prefix = await reader.readexactly(_PREFIX.size)
    (n,) = _PREFIX.unpack(prefix)
    return prefix + await reader.readexactly(n)


def _body(sealed: bytes) -> dict[str, object]:
    """The plaintext body of a sealed frame (length prefix, msgpack, 16-byte tag)."""
    decoded = msgpack.unpackb(sealed[_PREFIX.size : -TAG_BYTES], raw=False)
    return decoded if isinstance(decoded, dict) else {}

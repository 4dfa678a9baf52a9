"""A KV event publisher for tests that loses batches on purpose: a real ZMQ PUB socket and a
replay ROUTER speaking the publisher's wire format, whose live sends, replay buffer and replay
answers the test controls."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from kvtier.events import EventBatch
from kvtier.events.codec import encode_batch
from kvtier.events.publisher import END_OF_REPLAY, SEQ_BYTES, seq_frame


class LossyPublisher:
    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._replay):
            sock.setsockopt(zmq.LINGER, 0)
        self._pub.bind("tcp://127.0.0.1:*")
        self._replay.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.next_seq = 0
        self.replays_open = asyncio.Event()
        """Cleared: replay requests wait (the subscriber stays in its gap)."""
        self.replays_open.set()
        self._task = asyncio.create_task(self._serve())

    async def publish(self, batch: EventBatch, *, live: bool = True, keep: bool = True) -> int:
        """``live`` False: lost in transit; ``keep`` False: not in the replay buffer either."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(batch)
        if keep:
            self.buffer[seq] = payload
        if live:
            await self._pub.send_multipart((b"", seq_frame(seq), payload))
        return seq

    async def _serve(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            await self.replays_open.wait()
            for seq in sorted(s for s in self.buffer if s >= start):
                await self._replay.send_multipart(
                    (client, b"", b"", seq_frame(seq), self.buffer[seq])
                )
            await self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._pub.close(0)
        self._replay.close(0)
        self._ctx.term()

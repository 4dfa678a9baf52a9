"""Async ZMQ publisher of KV event batches with a replay buffer (vLLM's wire protocol).

Live batches go out on a PUB socket as three frames ``(topic, seq, payload)`` where ``seq`` is
an 8-byte big-endian counter starting at 0 and ``payload`` is :func:`codec.encode_batch`.
A ROUTER socket answers replay requests ``(identity, b"", start_seq)`` with every buffered
batch whose sequence is ``>= start_seq`` as ``(identity, b"", topic, seq, payload)`` and then
the end marker ``(identity, b"", b"", -1 as 8 signed bytes, b"")``, exactly as vLLM 0.32's
``ZmqEventPublisher`` answers, so vLLM's subscribers can use it and
:class:`kvtier.events.subscriber.EventSubscriber` replays from both (it also reads the older
topic-less ``(seq, payload)`` replies).

Who may connect: anyone who reaches the endpoints, unless ``curve`` is given (then only the
subscribers whose public keys it lists; see :mod:`kvtier.events.curve`). What they get: every
batch, including the prompt token ids of ``BlockStored`` — bind to a private network or use
CURVE. A replay request can ask for at most the whole buffer; malformed ones are skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import zmq
import zmq.asyncio

from kvtier.events.codec import EventEncoding, encode_batch
from kvtier.events.curve import ClientGate, CurveServer, make_server
from kvtier.events.types import EventBatch
from kvtier.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The sequence frame that ends a replay answer."""


def seq_frame(seq: int) -> bytes:
    """A sequence number as it travels on the wire."""
    return seq.to_bytes(SEQ_BYTES, "big")


class ReplayBuffer:
    """The last ``capacity`` published ``(seq, payload)`` pairs."""

    __slots__ = ("_items", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"replay buffer capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._items: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    def append(self, seq: int, payload: bytes) -> None:
        self._items.append((seq, payload))

    def since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Buffered batches with ``seq >= start_seq``, oldest first."""
        return [item for item in self._items if item[0] >= start_seq]

    def __len__(self) -> int:
        return len(self._items)


class EventPublisher:
    """Publishes :class:`EventBatch` es on ``endpoint``; serves replays on ``replay_endpoint``.

    Both endpoints are bound (``tcp://127.0.0.1:*`` picks a free port; read the bound address
    from :attr:`endpoint` / :attr:`replay_endpoint` after :meth:`start`). A ``data_parallel_rank``
    given here is stamped on batches that carry none, as vLLM's publisher does.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        encoding: EventEncoding = EventEncoding.ARRAY,
        data_parallel_rank: int | None = None,
        context: zmq.asyncio.Context | None = None,
        curve: CurveServer | None = None,
    ) -> None:
        """With ``curve``, both sockets are CURVE servers and a ZAP handler on the context
        (the publisher's own unless ``context`` is given: it must then have no other) admits
        only ``curve.allowed_clients``."""
        self._bind = endpoint
        self._curve = curve
        self._gate: ClientGate | None = None
        self._replay_bind = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._buffer = ReplayBuffer(buffer_steps)
        self._hwm = hwm
        self._encoding = encoding
        self._rank = data_parallel_rank
        self._given_ctx = context
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._next_seq = 0
        self._closed = False
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replays_served = 0

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._next_seq

    @property
    def refused_clients(self) -> int:
        """CURVE handshakes refused because the client's key is not admitted."""
        return self._gate.refused if self._gate is not None else 0

    async def start(self) -> None:
        """Bind the sockets and start serving replays."""
        if self._pub is not None or self._closed:
            raise RuntimeError("publisher already started or closed")
        ctx = self._ctx = self._given_ctx or zmq.asyncio.Context()
        try:
            if self._curve is not None:
                self._gate = ClientGate(ctx, self._curve)
                self._gate.start()
            pub = ctx.socket(zmq.PUB)
            self._pub = pub
            if self._curve is not None:
                make_server(pub, self._curve)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.bind(self._bind)
            self.endpoint = _last_endpoint(pub)
            if self._replay_bind is not None:
                replay = ctx.socket(zmq.ROUTER)
                self._replay = replay
                if self._curve is not None:
                    make_server(replay, self._curve)
                replay.setsockopt(zmq.LINGER, 0)
                # A replay answer is at most the whole buffer: never drop part of one.
                replay.setsockopt(zmq.SNDHWM, self._buffer.capacity + 2)
                replay.bind(self._replay_bind)
                self.replay_endpoint = _last_endpoint(replay)
                self._replay_task = asyncio.create_task(
                    self._serve_replays(replay), name="kv-events-replay"
                )
        except BaseException:
            await self.close()
            raise
        logger.info(
            "publishing KV events on %s (replay %s, %s)",
            self.endpoint,
            self.replay_endpoint,
            "CURVE" if self._curve is not None else "no CURVE: the network must be private",
        )

    async def publish(self, batch: EventBatch) -> int:
        """Send one batch; returns its sequence number. PUB never blocks: a slow subscriber
        loses messages past the high-water mark and recovers them by replay."""
        if self._pub is None or self._closed:
            raise RuntimeError("publisher is not running")
        if batch.data_parallel_rank is None and self._rank is not None:
            batch = EventBatch(batch.ts, batch.events, self._rank)
        payload = encode_batch(batch, self._encoding)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append(seq, payload)
        await self._pub.send_multipart((self._topic, seq_frame(seq), payload))
        return seq

    async def _serve_replays(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
                logger.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                # vLLM's replay reply: (topic, seq, payload) per batch, then an empty topic
                # with the end marker (frames after the DEALER's empty delimiter).
                for seq, payload in self._buffer.since(start_seq):
                    await sock.send_multipart((client, b"", self._topic, seq_frame(seq), payload))
                await sock.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
            except zmq.ZMQError:
                logger.exception("replay from seq %d failed", start_seq)
                continue
            self.replays_served += 1

    async def close(self) -> None:
        """Stop serving replays and close the sockets (idempotent)."""
        self._closed = True
        task, self._replay_task = self._replay_task, None
        try:
            await cancel_and_wait(task)
        finally:
            await self._close_sockets()

    async def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._gate is not None:
            await self._gate.stop()
            self._gate = None
        if self._ctx is not None and self._given_ctx is None:
            self._ctx.term()
        self._ctx = None

    async def __aenter__(self) -> EventPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _last_endpoint(sock: zmq.asyncio.Socket) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)

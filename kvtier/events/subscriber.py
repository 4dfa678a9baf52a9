"""Async ZMQ subscriber for KV event batches: in-order delivery, gap replay, restart detection.

Give it an engine's PUB endpoint (and its ROUTER replay endpoint) and two callbacks::

    sub = EventSubscriber(pub, replay, on_batch=lambda b: index.apply(node, b),
                          on_reset=lambda: index.forget(node))
    await sub.start()
    ...
    await sub.close()

Batches reach ``on_batch`` once each, in sequence order. On start, and whenever a sequence
number is skipped, the subscriber asks the replay socket for everything from the first
missing sequence. When events are lost for good (no replay socket, the replay buffer no longer
holds them, the replay timed out, or the publisher restarted and its sequence went back)
``on_reset`` is awaited first: the receiver's view of that engine can no longer be trusted.

An endpoint with a wildcard host (``tcp://*:PORT``), or any endpoint with ``bind=True``, makes
the subscriber bind and the engine connect to it (vLLM's PUB connects whenever its endpoint is a
concrete address: ``tcp://127.0.0.1:PORT`` on both sides keeps the events on loopback); any
other endpoint (``tcp://host:port``, ``ipc://path``) is connected to. A bound subscriber is a
listener: whoever reaches the port can publish events, which steer routing decisions (they
cannot fail a request or stall the subscriber), so bind on a private network only.

Malformed messages are counted in :attr:`EventSubscriber.stats` and skipped; a callback that
raises is logged and counted. Nothing a publisher sends stops the subscriber.

No message is read past ``max_message_bytes`` (:data:`DEFAULT_MAX_MESSAGE_BYTES`, 4 MiB, by
default; a frame, in fact, on the SUB socket and on every replay socket): libzmq
(``ZMQ_MAXMSGSIZE``) drops the connection that carries a larger one before reading it, and
reconnects. Whoever publishes (or reaches a bound subscriber) could otherwise make this process
read and decode a message of any size (one of 256 MiB cost a proxy 502 MiB). The dropped
message is then a loss like any other (gap, replay, reset); libzmq gives no reason for the drop,
so it is counted with its kind: ``stats.disconnects`` (live) and ``stats.replay_timeouts``
(replay). libzmq never reconnects a connection it dropped for a protocol error, so a connecting
subscriber connects afresh after every drop (a bound one is reconnected to by its peer). What
one subscriber can hold queued is ``rcvhwm`` messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtier.errors import EventDecodeError
from kvtier.events.codec import decode_batch
from kvtier.events.curve import CurveClient, make_client
from kvtier.events.publisher import END_OF_REPLAY, SEQ_BYTES, seq_frame
from kvtier.events.types import EventBatch

logger = logging.getLogger(__name__)

OnBatch = Callable[[EventBatch], Awaitable[None]]
OnReset = Callable[[], Awaitable[None]]
OnGap = Callable[[int | None], None]

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""Largest message (frame) a subscriber reads. A batch carries one engine step's events: a
step that stores 64k tokens in 16-token blocks encodes to about 0.4 MiB."""


@dataclass(slots=True)
class SubscriberStats:
    """Counters of one subscriber (read them any time; they only grow)."""

    received: int = 0
    """Well-formed live messages received on the SUB socket."""
    delivered: int = 0
    """Batches handed to ``on_batch`` (live and replayed)."""
    gaps: int = 0
    """Times a live sequence number skipped ahead of the next expected one."""
    replayed: int = 0
    """Batches delivered from replay answers."""
    duplicates: int = 0
    """Live messages skipped because replay had delivered them already."""
    malformed: int = 0
    """Messages skipped: wrong frame count, bad sequence frame, or undecodable payload."""
    resets: int = 0
    """Unrecoverable losses and publisher restarts (each awaited ``on_reset``)."""
    handler_errors: int = 0
    """Exceptions raised by ``on_batch`` / ``on_reset`` (logged, then ignored)."""
    disconnects: int = 0
    """Live connections to the publisher that dropped: its restart, the network, or a message
    over ``max_message_bytes`` (libzmq closes the connection rather than read it)."""
    replay_timeouts: int = 0
    """Replays that did not end within ``replay_timeout_s``: a publisher that does not answer,
    or an answer over ``max_message_bytes`` (its connection was dropped)."""


class EventSubscriber:
    """Subscribes to one publisher; see the module docstring for the delivery guarantees."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        on_batch: OnBatch,
        on_reset: OnReset | None = None,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        rcvhwm: int = 100_000,
        start_seq: int = 0,
        name: str = "",
        context: zmq.asyncio.Context | None = None,
        curve: CurveClient | None = None,
        on_gap: OnGap | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        bind: bool = False,
    ) -> None:
        """``curve``: the keys for a CURVE publisher (both sockets, live and replay).
        ``bind``: listen at ``endpoint`` for the publisher to connect (a wildcard endpoint
        always does); the replay socket is always connected to.
        ``on_gap(seq)``: called (synchronously, must not raise) when batches before live
        sequence ``seq`` are found missing and are about to be replayed, and with ``None``
        when the connection to the publisher drops; ``on_reset`` follows if they are lost.
        ``max_message_bytes``: no larger message is read (see the module docstring)."""
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
        self._max_message_bytes = max_message_bytes
        self._on_gap = on_gap
        self.endpoint = endpoint
        self._bind = bind or "*" in endpoint
        self._curve = curve
        self.replay_endpoint = replay_endpoint
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._topic = topic.encode("utf-8")
        self._replay_timeout_s = replay_timeout_s
        self._rcvhwm = rcvhwm
        self._expected = start_seq
        self._replayed_upto = -1
        self._name = name or endpoint
        self._given_ctx = context
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._publisher_lost = False
        self._closed = False
        self.stats = SubscriberStats()

    @property
    def next_seq(self) -> int:
        """The sequence number the subscriber expects next."""
        return self._expected

    @property
    def running(self) -> bool:
        """Started, not closed, and its receive loop has not died (a crash is logged)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Connect, catch up from the replay socket, then follow the live stream."""
        if self._sub is not None or self._closed:
            raise RuntimeError("subscriber already started or closed")
        ctx = self._ctx = self._given_ctx or zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        self._sub = sub
        if self._curve is not None:
            make_client(sub, self._curve)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        # Sequence numbers alone cannot tell a restarted publisher whose new sequence already
        # passed ours from a plain gap; a dropped connection can, so watch for it.
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_task = asyncio.create_task(
            self._watch_connection(monitor), name=f"kv-events-monitor {self._name}"
        )
        self._monitor = monitor
        try:
            if self._bind:
                # A wildcard names a socket to listen on: the engine connects to us, as vLLM
                # does whenever its own endpoint is a concrete address (it binds only
                # wildcards and ipc).
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except zmq.ZMQError:
            await self.close()  # e.g. the port is taken: release every socket, then say so
            raise
        self._task = asyncio.create_task(self._run(sub), name=f"kv-events-sub {self._name}")
        self._task.add_done_callback(self._log_crash)

    async def close(self) -> None:
        """Stop receiving and release the sockets (idempotent)."""
        self._closed = True
        if self._sub is not None:
            # Monitoring stops while its reader is still open: libzmq's I/O thread sends each
            # event to a PAIR socket, and a PAIR whose peer is gone blocks that send forever
            # (holding the monitor lock that disable_monitor and ctx.term then wait on).
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        tasks = [t for t in (self._task, self._monitor_task) if t is not None]
        self._task = self._monitor_task = None
        for task in tasks:
            task.cancel()
        # wait(), never ``await task`` under suppress(CancelledError): that swallowed a cancel
        # of the caller itself (a feed loop stopped while it unsubscribed ran on, and whoever
        # stopped it waited forever). The close still completes first: a replay socket left
        # open by an unfinished task would block ctx.term() in C.
        caller_cancelled: asyncio.CancelledError | None = None
        while tasks and not all(task.done() for task in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError as exc:
                caller_cancelled = exc
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._ctx is not None and self._given_ctx is None:
            self._ctx.term()
        self._ctx = None
        if caller_cancelled is not None:
            raise caller_cancelled

    async def __aenter__(self) -> EventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _log_crash(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("KV event subscriber %s stopped", self._name, exc_info=task.exception())

    async def _run(self, sub: zmq.asyncio.Socket) -> None:
        if self.replay_endpoint is not None:
            await self._replay_from_expected()
        while True:
            frames = await sub.recv_multipart()
            parsed = self._parse(frames)
            if parsed is None:
                continue
            seq, payload = parsed
            self.stats.received += 1
            if self._publisher_lost:
                self._publisher_lost = False
                await self._resync_after_disconnect(seq)
            if seq < self._expected:
                if seq <= self._replayed_upto:
                    self.stats.duplicates += 1
                    continue
                await self._reset(f"sequence went back from {self._expected} to {seq}")
                self._expected = 0
            if seq > self._expected:
                self.stats.gaps += 1
                self._gap(seq)
                logger.info("KV events from %s: gap %d..%d", self._name, self._expected, seq - 1)
                if self.replay_endpoint is not None:
                    await self._replay_from_expected()
                if seq < self._expected:
                    continue  # the replay delivered it
                if seq > self._expected:
                    await self._reset(f"batches {self._expected}..{seq - 1} are lost")
                    self._expected = seq
            self._replayed_upto = -1
            await self._deliver(seq, payload)

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self.stats.malformed += 1
            logger.warning("KV events from %s: malformed message skipped", self._name)
            return None
        if frames[0] != self._topic and self._topic:
            return None  # a longer topic that merely shares our prefix
        return int.from_bytes(frames[1], "big"), frames[2]

    async def _deliver(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.stats.malformed += 1
            logger.warning("KV events from %s: seq %d skipped: %s", self._name, seq, exc)
            return
        try:
            await self._on_batch(batch)
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("KV events from %s: handler failed on seq %d", self._name, seq)
        self.stats.delivered += 1

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        # Never closes the monitor socket itself (close() does, after disable_monitor): see
        # close() for the hang an early close causes.
        while True:
            frames = await monitor.recv_multipart()
            if parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                self._publisher_lost = True
                self._gap(None)
                await self._reconnect()

    async def _reconnect(self) -> None:
        """After a drop, connect afresh: libzmq does not reconnect a connection it dropped for
        a protocol error (a message over ``max_message_bytes``), and after any other drop this
        replaces its own reconnection (an explicit disconnect reports no further drop).

        Only once the messages the dropped connection delivered are read: disconnecting while
        some are still queued made libzmq abort the whole process (``Assertion failed: !_more
        (src/fq.cpp:80)``, libzmq 4.3.5) when a publisher that had sent large batches to a
        slower subscriber went away: any publisher could kill the proxy."""
        sub = self._sub
        if sub is None or self._closed or "*" in self.endpoint:
            return  # a bound subscriber: the publisher reconnects to it
        # The receive loop drains the queue; libzmq offers no event for "queue empty".
        while _readable(sub):
            await asyncio.sleep(0.05)
            if self._sub is not sub:
                return  # closed meanwhile
        try:
            with contextlib.suppress(zmq.ZMQError):
                sub.disconnect(self.endpoint)
            sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            logger.warning("KV events from %s: reconnect failed: %s", self._name, exc)

    def _gap(self, seq: int | None) -> None:
        if self._on_gap is None:
            return
        try:
            self._on_gap(seq)
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("KV events from %s: gap handler failed", self._name)

    async def _resync_after_disconnect(self, seq: int) -> None:
        """The connection dropped: the publisher may be a new process whose sequence started
        over. Its residency can no longer be trusted, so reset and re-read the whole replay
        buffer of whichever publisher is there now (after a mere network blip this forgets
        blocks older than the buffer: routing under-estimates, never over-trusts)."""
        await self._reset("connection to the publisher was lost (restart or network)")
        self._replayed_upto = -1
        if self.replay_endpoint is None:
            self._expected = seq
            return
        self._expected = 0
        await self._replay_from_expected()
        if self._expected == 0:
            self._expected = seq  # nothing replayed: follow the live stream from here

    async def _reset(self, reason: str) -> None:
        self.stats.resets += 1
        logger.warning("KV events from %s: %s; resetting", self._name, reason)
        if self._on_reset is None:
            return
        try:
            await self._on_reset()
        except Exception:
            self.stats.handler_errors += 1
            logger.exception("KV events from %s: reset handler failed", self._name)

    async def _replay_from_expected(self) -> None:
        """Ask for everything from the next expected sequence; deliver it in order."""
        assert self.replay_endpoint is not None
        start = self._expected
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            if self._curve is not None:
                make_client(sock, self._curve)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sock.connect(self.replay_endpoint)
            await sock.send_multipart((b"", seq_frame(start)))
            deadline = time.monotonic() + self._replay_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
                # lands as a frame arrives, and close() would wait for the replay loop forever.
                async with asyncio.timeout(remaining):
                    frames = await sock.recv_multipart()
                if len(frames) == 4:  # vLLM's reply carries the topic: (b"", topic, seq, payload)
                    frames = [frames[0], frames[2], frames[3]]
                if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                    self.stats.malformed += 1
                    continue
                if frames[1] == END_OF_REPLAY:
                    return
                seq = int.from_bytes(frames[1], "big")
                if seq < self._expected:
                    continue
                if seq > self._expected:
                    await self._reset(f"replay no longer holds {self._expected}..{seq - 1}")
                await self._deliver(seq, frames[2])
                self.stats.replayed += 1
                self._replayed_upto = max(self._replayed_upto, seq)
        except TimeoutError:
            self.stats.replay_timeouts += 1
            logger.warning(
                "KV events from %s: replay from %d timed out after %.2fs",
                self._name,
                start,
                self._replay_timeout_s,
            )
        finally:
            sock.close(linger=0)


def _readable(sock: zmq.asyncio.Socket) -> bool:
    """A message is queued on ``sock``."""
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)

"""The worker announces itself to a proxy (``--announce-endpoint``) instead of being listed.

A ZMQ DEALER, CURVE client of the proxy's registration ROUTER, sends the worker's
:class:`~kvtier.announce.Announcement` (vLLM's registration message: role, HTTP address, P2P
address, plus its model and KV event endpoints) every ``announce_interval_s``; the proxy drains
a worker whose heartbeats stop. On shutdown the worker says it is leaving, so the proxy stops
routing to it at once rather than at the heartbeat timeout; requests already in flight finish.

The first announcement waits until the worker's HTTP port accepts connections (the app's
lifespan starts before uvicorn listens), so the proxy never routes to a port not yet open.

Sends never block and never queue stale heartbeats: a message goes out only on a connection
whose handshake completed (``ZMQ_IMMEDIATE``); otherwise it is dropped and retried shortly
(libzmq reconnects by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Protocol, runtime_checkable

import zmq

from kvtier.announce import Announcement, Kind, encode
from kvtier.events.curve import CurveClient, load_client, make_client
from kvtier.tasks import cancel_and_wait
from kvtier.worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

_KINDS: dict[str, Kind] = {"producer": "P", "consumer": "D", "both": "PD"}
_ANY_HOST = ("0.0.0.0", "::", "", "*")
_SNDHWM = 4
_LINGER_MS = 1000
_RETRY_S = 0.1
"""After a dropped heartbeat (no connection yet), try again this soon."""
_LISTEN_WAIT_S = 120.0


@runtime_checkable
class ServesP2P(Protocol):
    """A KV connector with a P2P server (its port, once started)."""

    @property
    def p2p_port(self) -> int: ...


def advertised_host(settings: WorkerSettings) -> str:
    """The host others reach this worker at (the P2P connector's rule)."""
    host = settings.advertise_host or settings.host
    return "127.0.0.1" if host in _ANY_HOST else host


def worker_announcement(settings: WorkerSettings, p2p_port: int) -> Announcement:
    host = advertised_host(settings)
    shown = f"[{host}]" if ":" in host else host
    return Announcement(
        kind=_KINDS[settings.role],
        http_address=f"{shown}:{settings.port}",
        zmq_address=f"{shown}:{p2p_port}" if p2p_port else None,
        name=settings.announce_name,
        models=(settings.model_name,),
        dialect="p2p",
        events_endpoint=_reachable(settings.events_endpoint, shown),
        events_replay_endpoint=_reachable(settings.events_replay_endpoint, shown),
        dp_size=settings.data_parallel_size,
    )


def _reachable(endpoint: str | None, host: str) -> str | None:
    """A bound ``tcp://*:5557`` as others reach it (``tcp://host:5557``)."""
    if endpoint is None or not endpoint.startswith("tcp://"):
        return None
    bound_host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return f"tcp://{host}:{port}" if bound_host.strip("[]") in _ANY_HOST else endpoint


class Announcer:
    def __init__(
        self,
        endpoint: str,
        announcement: Announcement,
        keys: CurveClient,
        interval_s: float,
        *,
        listening: tuple[str, int] | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._listening = listening
        """The worker's own HTTP ``(host, port)``: announced only once it accepts connections."""
        self._announcement = announcement
        self._keys = keys
        self._interval_s = interval_s
        # A plain (not asyncio) socket: every send is NOBLOCK, so it never waits, and a send's
        # failure is known at once (leave() is called from synchronous shutdown code).
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.dropped = 0

    @classmethod
    def from_settings(cls, settings: WorkerSettings, p2p_port: int) -> Announcer | None:
        endpoint = settings.announce_endpoint
        if endpoint is None:
            return None
        secret = settings.announce_curve_secret_key_file
        server = settings.announce_curve_server_key_file
        assert secret is not None and server is not None  # the settings require both
        local = "127.0.0.1" if settings.host in _ANY_HOST else settings.host
        return cls(
            endpoint,
            worker_announcement(settings, p2p_port),
            load_client(secret, server),
            settings.announce_interval_s,
            listening=(local, settings.port),
        )

    def start(self) -> None:
        if self._sock is not None:
            return
        self._ctx = zmq.Context()
        sock = self._sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        # vLLM's DEALER names itself by its zmq address.
        identity = self._announcement.zmq_address or self._announcement.http_address
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        make_client(sock, self._keys)
        sock.connect(self._endpoint)
        self._task = asyncio.get_running_loop().create_task(
            self._heartbeat(), name="kvtier-worker-announce"
        )
        logger.info("announcing %s to %s", self._announcement.http_address, self._endpoint)

    async def _heartbeat(self) -> None:
        payload = encode(self._announcement)
        if self._listening is not None:
            await _until_listening(*self._listening)
        while True:
            sent = self._send(payload)
            await asyncio.sleep(self._interval_s if sent else min(self._interval_s, _RETRY_S))

    def _send(self, payload: bytes) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def leave(self) -> None:
        """Stop heartbeating and tell the proxy this worker is leaving. Idempotent."""
        if self._task is None:
            return
        self._task.cancel()
        self._task = None
        self._send(encode(replace(self._announcement, leaving=True)))
        logger.info("announced leaving to %s", self._endpoint)

    async def close(self) -> None:
        """Leave (if not yet), then close the socket, letting the last message out."""
        task = self._task
        self.leave()
        try:
            await cancel_and_wait(task)  # a cancel of this close is raised after the rest
        finally:
            if self._sock is not None:
                self._sock.close()  # lingers up to _LINGER_MS for the leaving message
                self._sock = None
            if self._ctx is not None:
                ctx, self._ctx = self._ctx, None
                await asyncio.to_thread(ctx.term)


async def _until_listening(host: str, port: int) -> None:
    """Until ``host:port`` accepts a TCP connection (bounded; then announce anyway: the
    proxy's health checks and retries cover a port that never opens)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _LISTEN_WAIT_S
    while loop.time() < deadline:
        try:
            async with asyncio.timeout(1.0):  # wait_for (3.11) can drop a cancel here
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            await asyncio.sleep(_RETRY_S)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    logger.warning("%s:%d did not accept connections; announcing anyway", host, port)

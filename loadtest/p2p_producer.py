"""The producer end of ``loadtest.bench_p2p``: a prefill worker, in this process or its own.

A :class:`Producer` is what a prefill worker holds for P2P: device pages, a host pool, a tiering
manager with the P2P tier, and the P2P server on its own event loop thread. In production the
producer and the consumer are different processes (different machines, mostly); with
``--ends processes`` the benchmark runs the producer in a child process
(:class:`ProducerProcess`), so both ends have their own interpreter lock, as they would. The
default keeps both in one process (the two ends' Python then competes for one lock).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import uvloop

from kvtier.heap import freeze_startup_heap
from kvtier.keys import OffloadKey
from kvtier.offload import HostPagePool, TieringManager
from kvtier.offload.types import ReqContext, RequestId
from kvtier.p2p import (
    LayoutFingerprint,
    LocalIdentity,
    P2PServer,
    P2PSettings,
    P2PTier,
    SupplyRegistry,
)
from kvtier.pages import CopyDirection, DevicePages, HostPages, PageCopier

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
LOOPS: dict[str, LoopFactory] = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


@dataclass(frozen=True, slots=True)
class Shape:
    tokens: int
    token_bytes: int
    block_size: int

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def total(self) -> int:
        return self.blocks * self.page_bytes


@dataclass(frozen=True, slots=True)
class Leg:
    """One producer leg as the producer's process saw it."""

    wall_s: float
    cpu_s: float


class Producer:
    """A prefill worker: device pages, host pool, tiering manager with the P2P tier, server."""

    def __init__(
        self, shape: Shape, fingerprint: LayoutFingerprint, settings: P2PSettings, loop: str
    ) -> None:
        self.shape = shape
        block_elems = shape.page_bytes // 2
        self.device = DevicePages.allocate(shape.blocks, (block_elems,), torch.float16)
        self.device.block_bytes.copy_(
            torch.arange(self.device.block_bytes.numel(), dtype=torch.int64)
            .remainder(251)
            .to(torch.uint8)
            .reshape(self.device.block_bytes.shape)
        )
        self.host = HostPages(shape.blocks, shape.page_bytes)
        self.pool = HostPagePool(self.host)
        self.copier = PageCopier(self.device, self.host, 1)
        self.registry = SupplyRegistry(settings.lease_s)
        self.tier = P2PTier(self.pool, self.registry, fingerprint)
        self.manager = TieringManager(self.pool, [self.tier])
        identity = LocalIdentity.from_settings("producer", fingerprint, settings)
        self.loop = LOOPS[loop]()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = P2PServer(settings, identity, self.registry)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    @property
    def port(self) -> int:
        return self.server.port

    def prefill(self, kv_request_id: str, keys: list[OffloadKey], chunk: int = 32) -> Leg:
        """One producer leg (runs on the calling "engine" thread)."""
        cpu0, t0 = time.process_time(), time.perf_counter()
        ctx = ReqContext(
            RequestId(f"prefill-{kv_request_id}"),
            kv_transfer_params={"remote_decoder": {"kv_request_id": kv_request_id}},
        )
        self.manager.on_new_request(ctx)
        for start in range(0, len(keys), chunk):
            out = self.manager.prepare_store(keys[start : start + chunk], ctx)
            if out.keys_to_store:
                blocks = [start + keys[start:].index(k) for k in out.keys_to_store]
                job = self.copier.submit(
                    CopyDirection.DEVICE_TO_HOST, blocks, list(out.store_spec.page_indices)
                )
                self.copier.wait(job, 30.0)
                self.manager.complete_store(out.keys_to_store, ctx, True)
        self.manager.on_request_finished(ctx)
        return Leg(time.perf_counter() - t0, time.process_time() - cpu0)

    def cpu_s(self) -> float:
        """CPU time the producer used (only meaningful in its own process)."""
        return time.process_time()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.manager.close()


class ProducerProcess:
    """A :class:`Producer` in a child process (spawned: no forked CUDA or loop state),
    driven over a pipe: ``prefill`` and ``cpu_s`` as on the in-process one."""

    def __init__(
        self, shape: Shape, fingerprint: LayoutFingerprint, settings: P2PSettings, loop: str
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve_producer, args=(child, shape, fingerprint, settings, loop), daemon=True
        )
        self._process.start()
        child.close()
        port = self._call("port")
        assert isinstance(port, int)
        self.port = port

    def prefill(self, kv_request_id: str, keys: list[OffloadKey]) -> Leg:
        leg = self._call("prefill", kv_request_id, keys)
        assert isinstance(leg, Leg)
        return leg

    def cpu_s(self) -> float:
        cpu = self._call("cpu")
        assert isinstance(cpu, float)
        return cpu

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self._conn.close()
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def _call(self, *command: object) -> object:
        self._conn.send(command)
        if not self._conn.poll(120):
            raise TimeoutError(f"producer process did not answer {command[0]!r}")
        answer = self._conn.recv()
        if isinstance(answer, BaseException):
            raise RuntimeError("producer process failed") from answer
        return answer


def _serve_producer(
    conn: Connection, shape: Shape, fingerprint: LayoutFingerprint, settings: P2PSettings, loop: str
) -> None:
    producer = Producer(shape, fingerprint, settings, loop)
    freeze_startup_heap()  # as a worker's main does once it started
    try:
        while True:
            command = conn.recv()
            try:
                match command:
                    case ("port",):
                        conn.send(producer.port)
                    case ("prefill", str(kv_request_id), list(keys)):
                        conn.send(producer.prefill(kv_request_id, keys))
                    case ("cpu",):
                        conn.send(producer.cpu_s())
                    case ("close",):
                        conn.send(None)
                        return
                    case _:
                        conn.send(ValueError(f"unknown command {command!r}"))
            except Exception as exc:  # the parent re-raises it
                conn.send(exc)
    finally:
        producer.close()

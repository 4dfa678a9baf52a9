"""The worker: engine, KV connector and event publishing, started and stopped together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvtier.events import EventPublisher
from kvtier.events.curve import CurveServer, load_server
from kvtier.tasks import cancel_and_wait
from kvtier.worker.announce import Announcer, ServesP2P
from kvtier.worker.build import build_engine
from kvtier.worker.connector import KVConnector
from kvtier.worker.engine import Engine
from kvtier.worker.kv_events import KVEventRelay
from kvtier.worker.lora import LoraAdapters
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.stats import EngineStats
from kvtier.worker.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

ConnectorFactory = Callable[["Worker"], KVConnector | None]


class Worker:
    """One worker process's engine, kvtier connector and residency events."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        connector_factory: ConnectorFactory | None = None,
        data_parallel_rank: int | None = None,
    ) -> None:
        """``data_parallel_rank``: this engine's rank when the worker runs several
        (:mod:`kvtier.worker.ranks`); stamped on its KV event batches."""
        self.settings = settings
        self.data_parallel_rank = data_parallel_rank
        self.stats = EngineStats()
        self.tokenizer = ByteTokenizer()
        self.loras = LoraAdapters(settings.model_name, settings.max_loras)
        for module in settings.lora_modules:
            name, _, path = module.partition("=")
            self.loras.load(name, path)
        publisher = (
            EventPublisher(
                settings.events_endpoint,
                settings.events_replay_endpoint,
                curve=_event_keys(settings),
                data_parallel_rank=data_parallel_rank,
            )
            if settings.events_endpoint
            else None
        )
        self.events = KVEventRelay(publisher, settings.block_size)
        self.engine: Engine = build_engine(
            settings,
            on_stored=self.events.on_device_stored,
            on_removed=self.events.on_device_removed,
            stats=self.stats,
        )
        self.connector: KVConnector | None = (
            connector_factory(self) if connector_factory is not None else None
        )
        self._drain: asyncio.Task[None] | None = None
        self.announcer: Announcer | None = None

    async def start(self) -> None:
        await self.engine.start()
        try:
            if self.connector is not None:
                await self.connector.start()
            await self.events.start()
            p2p_port = self.connector.p2p_port if isinstance(self.connector, ServesP2P) else 0
            self.announcer = Announcer.from_settings(self.settings, p2p_port)
            if self.announcer is not None:
                self.announcer.start()
        except BaseException:
            await self.close()
            raise

    def begin_shutdown(self) -> None:
        """Stop admitting requests; those in flight get ``settings.shutdown_timeout_s`` to finish
        before they are aborted. :meth:`close` then stops everything. Idempotent."""
        if self._drain is None:
            if self.announcer is not None:
                self.announcer.leave()  # the proxy stops routing here before we refuse
            self.engine.stop_admitting()
            logger.info(
                "shutting down: no new requests; %d running, %d waiting",
                self.engine.num_running,
                self.engine.num_waiting,
            )
            self._drain = asyncio.create_task(
                self.engine.drain(self.settings.shutdown_timeout_s), name="kvtier-worker-drain"
            )

    async def close(self) -> None:
        if self.announcer is not None:
            await self.announcer.close()
        try:
            await cancel_and_wait(self._drain)
        finally:
            try:
                await self.engine.close()
            finally:
                try:
                    if self.connector is not None:
                        await self.connector.close()
                finally:
                    await self.events.close()


def _event_keys(settings: WorkerSettings) -> CurveServer | None:
    """CURVE keys of the event sockets, when configured (both paths or neither: settings)."""
    secret, clients = settings.events_curve_secret_key_file, settings.events_curve_clients_dir
    if secret is None or clients is None:
        return None
    return load_server(secret, clients)

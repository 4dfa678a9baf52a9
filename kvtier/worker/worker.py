"""The worker: engine, KV connector and event publishing, started and stopped together."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.events import EventPublisher
from kvtier.worker.build import build_engine
from kvtier.worker.connector import KVConnector
from kvtier.worker.engine import Engine
from kvtier.worker.kv_events import KVEventRelay
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.stats import EngineStats
from kvtier.worker.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

ConnectorFactory = Callable[["Worker"], KVConnector | None]


class Worker:
    """One worker process's engine, kvtier connector and residency events."""

    def __init__(
        self, settings: WorkerSettings, *, connector_factory: ConnectorFactory | None = None
    ) -> None:
        self.settings = settings
        self.stats = EngineStats()
        self.tokenizer = ByteTokenizer()
        publisher = (
            EventPublisher(settings.events_endpoint, settings.events_replay_endpoint)
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

    async def start(self) -> None:
        await self.engine.start()
        try:
            if self.connector is not None:
                await self.connector.start()
            await self.events.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        try:
            await self.engine.close()
        finally:
            try:
                if self.connector is not None:
                    await self.connector.close()
            finally:
                await self.events.close()

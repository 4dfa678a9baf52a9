"""KV event subscriptions: each backend's events applied to the residency index.

Batches go straight to the index, never through the router's breaker: an index that fails an
apply knows it missed events and resyncs the node on its next successful apply (RedisIndex does),
whereas a batch the router skipped would be lost silently. Failures are counted and logged once
per outage. Lost events (the subscriber's reset) forget the node, except when a new subscription
to a shared index starts after the publisher's replay buffer has moved on: the shared state was
kept current by the other replicas, and wiping it would undo their work. Nothing here raises
into the subscriber.

Event sockets carry prompt token ids. With ``events_curve`` keys every subscription (live and
replay) is CURVE-encrypted and checks the worker's public key; a backend whose server key is not
configured is refused a subscription (logged) rather than followed in plain text. Key files are
read once, at construction; a missing or malformed one is a :class:`ConfigError` naming the file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from kvtier.errors import EventSecurityError, ResidencyError
from kvtier.events import EventBatch, EventSubscriber
from kvtier.events.curve import CurveClient, load_client
from kvtier.residency.types import NodeId, ResidencyIndex
from pdproxy.errors import ConfigError
from pdproxy.routing.kv.settings import EventsCurveSettings

logger = logging.getLogger(__name__)


class EventFeeds:
    def __init__(
        self,
        index: ResidencyIndex,
        on_apply_error: Callable[[], None],
        *,
        shared: bool = False,
        replay_timeout_s: float = 1.0,
        curve: EventsCurveSettings | None = None,
    ) -> None:
        self._keys = _FeedKeys(curve) if curve is not None else None
        self._index = index
        self._shared = shared
        self._on_apply_error = on_apply_error
        self._replay_timeout_s = replay_timeout_s
        self._subs: dict[NodeId, EventSubscriber] = {}
        self._failing: set[NodeId] = set()

    @property
    def nodes(self) -> list[NodeId]:
        return sorted(self._subs)

    def subscriber(self, node: str) -> EventSubscriber | None:
        return self._subs.get(NodeId(node))

    async def subscribe(self, node: str, endpoint: str, replay_endpoint: str | None) -> None:
        """Follow ``node``'s events (replacing an earlier subscription of the same node)."""
        nid = NodeId(node)
        await self.unsubscribe(node)
        keys: CurveClient | None = None
        if self._keys is not None:
            keys = self._keys.for_node(node)
            if keys is None:
                logger.error(
                    "KV events for %s not followed: events_curve names no server key for it",
                    node,
                )
                return

        delivered = False

        async def on_batch(batch: EventBatch) -> None:
            nonlocal delivered
            delivered = True
            await self._apply(nid, batch)

        async def on_reset() -> None:
            if self._shared and not delivered:
                logger.info(
                    "KV events for %s: joining late; the shared index keeps its state", node
                )
                return
            await self._forget(nid)

        sub = EventSubscriber(
            endpoint,
            replay_endpoint,
            on_batch=on_batch,
            on_reset=on_reset,
            replay_timeout_s=self._replay_timeout_s,
            name=f"{node}@{endpoint}",
            curve=keys,
        )
        self._subs[nid] = sub
        await sub.start()

    async def unsubscribe(self, node: str) -> None:
        sub = self._subs.pop(NodeId(node), None)
        if sub is not None:
            await sub.close()

    async def close(self) -> None:
        for node in list(self._subs):
            await self.unsubscribe(node)

    async def _apply(self, node: NodeId, batch: EventBatch) -> None:
        try:
            await self._index.apply(node, batch)
        except ResidencyError as exc:
            if node not in self._failing:
                logger.warning("KV events for %s not applied (%s)", node, exc)
            self._failing.add(node)
            self._on_apply_error()
            return
        if node in self._failing:
            self._failing.discard(node)
            logger.info("KV events for %s apply again", node)

    async def _forget(self, node: NodeId) -> None:
        try:
            await self._index.forget(node)
        except ResidencyError as exc:
            logger.warning("KV events for %s were lost and forget failed: %s", node, exc)


class _FeedKeys:
    """The proxy's client certificate and each worker's public one, loaded once."""

    def __init__(self, settings: EventsCurveSettings) -> None:
        secret = settings.client_secret_key_file
        self._shared = self._load(secret, settings.server_public_key_file)
        self._per_node = {
            node: keys
            for node, path in settings.server_public_key_files.items()
            if (keys := self._load(secret, path)) is not None
        }

    def for_node(self, node: str) -> CurveClient | None:
        return self._per_node.get(node, self._shared)

    @staticmethod
    def _load(secret: Path, server_public: Path | None) -> CurveClient | None:
        if server_public is None:
            return None
        try:
            return load_client(secret, server_public)
        except EventSecurityError as exc:
            raise ConfigError(f"events_curve: {exc}") from exc

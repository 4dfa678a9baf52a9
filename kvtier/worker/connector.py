"""The seam between the engine and KV transfer: what a producer or consumer leg needs.

:class:`KVConnector` is implemented by :class:`kvtier.worker.p2p_connector.P2PConnector`
(tiering manager + kvtier P2P). The server calls it for legs that carry ``kv_transfer_params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.worker.kv_params import ConsumerLeg, KvSource, ProducerLeg
from kvtier.worker.request import EngineRequest, PromptKVHook


@dataclass(slots=True)
class ProducerOutcome:
    """Filled by a producer leg's hook: the ``kv_transfer_params`` to answer with."""

    answer: dict[str, object] | None = None


class KVConnector(Protocol):
    """KV transfer for producer and consumer legs."""

    def producer_hook(
        self, leg: ProducerLeg, request_id: str, outcome: ProducerOutcome
    ) -> PromptKVHook | None:
        """A hook that supplies the finished prompt's blocks under ``leg.kv_request_id`` and
        fills ``outcome``; None when this worker cannot supply (the leg then runs plainly)."""
        ...

    async def load_remote(self, req: EngineRequest, leg: ConsumerLeg) -> None:
        """Before ``req`` is submitted: fetch the prompt blocks the local cache lacks and install
        them into the prefix cache (pinned for ``req``); sets ``req.expected_remote_blocks``.
        Never raises for transport failures and returns within the fetch deadline."""
        ...

    async def pull_remote(self, req: EngineRequest, source: KvSource) -> None:
        """Before ``req`` is submitted: pull the prompt blocks the local cache lacks from the
        holder ``source`` (``remote_kv_source``) and install them like :meth:`load_remote`.
        Never raises for transport failures and returns within the fetch deadline."""
        ...

    def release(self, kv_request_id: str) -> bool:
        """Drop a supply (the consumer or proxy says it is no longer needed)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

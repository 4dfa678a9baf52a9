"""A request's prompt → token ids → chained block hashes of its routed prefix.

At most ``max_route_blocks`` leading blocks are hashed (the decision routes on that prefix, so
one huge prompt costs the event loop a bounded amount of hashing, matching and prediction);
hashing runs in a thread above ``inline_hash_blocks``. A request that cannot be hashed
faithfully (images, embeddings, tokenizer failure, invalid token ids) yields the reason as a
string, and the decision goes on by load alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import InvalidTokensError
from kvtier.keys import BlockHash, BlockHasher
from pdproxy.routing.base import RouteRequest
from pdproxy.routing.kv.telemetry import KvRouterMetrics
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.tokenize.base import Tokenizer, token_ids
from pdproxy.tokenize.errors import TokenizationError
from pdproxy.tokenize.prompt import Unhashable, cache_salt_of, prompt_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    tokens: int
    """The prompt's length in tokens (all of it, past ``max_route_blocks`` too)."""
    hashes: list[BlockHash]
    """Chained hashes of its routed prefix's full blocks."""


class PromptHasher:
    def __init__(
        self, settings: KvRouterSettings, tokenizer: Tokenizer, metrics: KvRouterMetrics
    ) -> None:
        self._settings = settings
        self.tokenizer = tokenizer
        self._metrics = metrics
        self.hasher = BlockHasher(settings.model_seed, settings.block_size)

    async def hash(self, request: RouteRequest) -> HashedPrompt | str:
        prompt = prompt_of(request.endpoint, request.body)
        reason: str
        if isinstance(prompt, Unhashable):
            reason = prompt.reason
        else:
            try:
                ids = await token_ids(self.tokenizer, prompt)
                hashes = await self._hash_prefix(ids, cache_salt_of(request.body))
                return HashedPrompt(len(ids), hashes)
            except TokenizationError as exc:
                logger.info("route %s: tokenizer failed (%s); load only", request.request_id, exc)
                reason = "tokenizer-error"
            except InvalidTokensError:
                reason = "invalid-tokens"
        self._metrics.unhashable.labels(reason).inc()
        return reason

    async def _hash_prefix(self, ids: Sequence[int], salt: str | None) -> list[BlockHash]:
        """Hashes of the first ``max_route_blocks`` blocks, in a thread when there are many."""
        bs = self._settings.block_size
        prefix = ids[: self._settings.max_route_blocks * bs]
        if len(prefix) // bs > self._settings.inline_hash_blocks:
            self._metrics.offloaded_hashes.inc()
            return await asyncio.to_thread(self.hasher.hash_tokens, prefix, cache_salt=salt)
        return self.hasher.hash_tokens(prefix, cache_salt=salt)

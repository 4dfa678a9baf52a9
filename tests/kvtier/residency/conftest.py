"""Fixtures: one residency index per implementation (Redis ones on the real test server),
and a fake engine that publishes vLLM-shaped events for token sequences."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import xxhash

from kvtier.events import BlockRemoved, BlockStored, EventBatch
from kvtier.keys import BlockHash, BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.redis_index import RedisIndex, RedisIndexSettings
from kvtier.residency.types import ResidencyIndex
from tests.redis_cluster import redis_cluster_url

__all__ = ["redis_cluster_url"]  # the session's cluster, for the "cluster" index

BLOCK = 4
MODEL = "contract-model"


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher(MODEL, BLOCK)


def redis_index(
    url: str,
    hasher: BlockHasher,
    deadline_s: float = 2.0,
    apply_deadline_s: float = 5.0,
    **extra: object,
) -> RedisIndex:
    """A RedisIndex in a namespace of its own; generous deadlines unless a test sets them."""
    settings = RedisIndexSettings.model_validate(
        {
            "url": url,
            "namespace": f"t-{uuid.uuid4().hex[:8]}",
            "deadline_s": deadline_s,
            "apply_deadline_s": apply_deadline_s,
            **extra,
        }
    )
    return RedisIndex(hasher, settings)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ]
)
async def index(
    request: pytest.FixtureRequest, hasher: BlockHasher
) -> AsyncIterator[ResidencyIndex]:
    if request.param == "memory":
        idx: ResidencyIndex = MemoryIndex(hasher)
    elif request.param == "redis":
        idx = redis_index(request.getfixturevalue("redis_url"), hasher)
    else:
        idx = redis_index(request.getfixturevalue("redis_cluster_url"), hasher)
    try:
        yield idx
    finally:
        await idx.close()


class FakeEngine:
    """Hashes blocks its own way (64-bit ints over the whole token prefix), like vLLM."""

    def __init__(self, block_size: int = BLOCK, medium: str | None = "GPU") -> None:
        self.block_size = block_size
        self.medium = medium

    def engine_hash(self, tokens: Sequence[int], end_block: int) -> int:
        data = b"".join(t.to_bytes(4, "little") for t in tokens[: end_block * self.block_size])
        return xxhash.xxh3_64_intdigest(b"engine" + data)

    def stored(
        self, tokens: Sequence[int], start: int, end: int, medium: str | None = None, **kw: object
    ) -> BlockStored:
        bs = self.block_size
        return BlockStored(
            block_hashes=tuple(self.engine_hash(tokens, b + 1) for b in range(start, end)),
            parent_block_hash=self.engine_hash(tokens, start) if start > 0 else None,
            token_ids=tuple(tokens[start * bs : end * bs]),
            block_size=bs,
            lora_id=None,
            medium=medium if medium is not None else self.medium,
            **kw,  # type: ignore[arg-type]
        )

    def removed(
        self, tokens: Sequence[int], blocks: Sequence[int], medium: str | None = None
    ) -> BlockRemoved:
        return BlockRemoved(
            tuple(self.engine_hash(tokens, b + 1) for b in blocks),
            medium if medium is not None else self.medium,
        )


def batch(*events: BlockStored | BlockRemoved) -> EventBatch:
    return EventBatch(ts=0.0, events=tuple(events))


def prompt_hashes(hasher: BlockHasher, tokens: Sequence[int]) -> list[BlockHash]:
    return hasher.hash_tokens(tokens)

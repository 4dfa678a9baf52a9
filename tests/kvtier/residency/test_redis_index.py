"""RedisIndex beyond the shared contract: sharing, script loss, deadlines, resync."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from kvtier.errors import ResidencyUnavailable
from kvtier.keys import BlockHasher
from kvtier.residency.redis_client import hash_tag
from kvtier.residency.redis_index import RedisIndex, RedisIndexSettings
from kvtier.residency.redis_layout import block_id, holders
from kvtier.residency.types import Match, NodeId

from .conftest import BLOCK, FakeEngine, batch, redis_index

pytestmark = pytest.mark.redis

A, B = NodeId("node-a"), NodeId("node-b")
TOKENS = list(range(7, 7 + 6 * BLOCK))
DEADLINE = 0.05


def full(n: int) -> Match:
    return Match(gpu=n, cpu=0, total=n, predicted=n)


def test_hash_tag_keeps_one_slot() -> None:
    assert hash_tag("kvtier", "llama") == "{kvtier:llama}"
    assert hash_tag("ns", "we{ird}") == "{ns:weird}"


async def test_two_proxies_share_residency(redis_url: str, hasher: BlockHasher) -> None:
    settings = RedisIndexSettings(url=redis_url, namespace="shared")
    writer, reader = RedisIndex(hasher, settings), RedisIndex(hasher, settings)
    try:
        await writer.apply(A, batch(FakeEngine().stored(TOKENS, 0, 4)))
        await reader.predict(B, hasher.hash_tokens(TOKENS)[:2], ttl_s=30)
        hashes = hasher.hash_tokens(TOKENS)
        expected = {A: full(4), B: Match(predicted=2)}
        assert await reader.match(hashes) == expected
        assert await writer.match(hashes) == expected
        await reader.forget(A)
        assert await writer.match(hashes) == {B: Match(predicted=2)}
    finally:
        await writer.close()
        await reader.close()


async def test_models_do_not_share_keys(redis_url: str) -> None:
    settings = RedisIndexSettings(url=redis_url)
    one, two = BlockHasher("one", BLOCK), BlockHasher("two", BLOCK)
    a, b = RedisIndex(one, settings), RedisIndex(two, settings)
    try:
        await a.apply(A, batch(FakeEngine().stored(TOKENS, 0, 3)))
        assert await b.nodes() == []
        client = Redis.from_url(redis_url)
        keys = await client.keys("*")
        await client.aclose()
        assert keys and all(k.startswith(b"{kvtier:one}:") for k in keys)  # type: ignore[arg-type]
    finally:
        await a.close()
        await b.close()


async def test_scripts_reload_after_redis_loses_them(redis_url: str, hasher: BlockHasher) -> None:
    idx = redis_index(redis_url, hasher)
    try:
        await idx.apply(A, batch(FakeEngine().stored(TOKENS, 0, 2)))
        client = Redis.from_url(redis_url)
        await client.script_flush()
        await client.aclose()
        assert await idx.match(hasher.hash_tokens(TOKENS)) == {A: full(2)}
    finally:
        await idx.close()


async def test_batches_pipeline_in_order(redis_url: str, hasher: BlockHasher) -> None:
    idx = redis_index(redis_url, hasher)
    eng = FakeEngine()
    try:
        await idx.apply_many(
            [
                (A, batch(eng.stored(TOKENS, 0, 4))),
                (B, batch(eng.stored(TOKENS, 0, 6))),
                (A, batch(eng.removed(TOKENS, [2]))),
            ]
        )
        assert await idx.match(hasher.hash_tokens(TOKENS)) == {A: full(2), B: full(6)}
    finally:
        await idx.close()


async def _assert_fast_failure(idx: RedisIndex, hasher: BlockHasher) -> None:
    hashes = hasher.hash_tokens(TOKENS)
    for call in (
        lambda: idx.match(hashes),
        lambda: idx.predict(A, hashes, 1.0),
        idx.nodes,
        lambda: idx.apply(A, batch(FakeEngine().stored(TOKENS, 0, 1))),
    ):
        t0 = time.monotonic()
        with pytest.raises(ResidencyUnavailable):
            await call()
        # apply has its own (longer) deadline; everything else gets DEADLINE.
        assert time.monotonic() - t0 < 0.2 + 0.5


async def test_paused_redis_fails_within_the_deadline(own_redis, hasher: BlockHasher) -> None:  # type: ignore[no-untyped-def]
    idx = redis_index(own_redis.url, hasher, deadline_s=DEADLINE, apply_deadline_s=0.1)
    try:
        await idx.apply(A, batch(FakeEngine().stored(TOKENS, 0, 3)))
        own_redis.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(ResidencyUnavailable):
                await idx.match(hasher.hash_tokens(TOKENS))
            assert time.monotonic() - t0 < DEADLINE + 0.45  # milliseconds, not seconds
            await _assert_fast_failure(idx, hasher)
        finally:
            own_redis.resume()
        # Recovers by itself: the failed apply is resynced by the next one.
        await idx.apply(A, batch())
        assert await idx.match(hasher.hash_tokens(TOKENS)) == {A: full(3)}
        # A forget that timed out (Redis may or may not run it once it wakes up) still
        # forgets: the node's next apply clears whatever Redis kept.
        own_redis.pause()
        try:
            with pytest.raises(ResidencyUnavailable):
                await idx.forget(A)
        finally:
            own_redis.resume()
        await idx.apply(A, batch())
        assert await idx.match(hasher.hash_tokens(TOKENS)) == {}
    finally:
        await idx.close()


async def test_stopped_redis_fails_fast_and_resyncs(own_redis, hasher: BlockHasher) -> None:  # type: ignore[no-untyped-def]
    idx = redis_index(own_redis.url, hasher, deadline_s=DEADLINE, apply_deadline_s=0.1)
    eng = FakeEngine()
    try:
        await idx.apply(A, batch(eng.stored(TOKENS, 0, 2)))
        own_redis.stop()
        await _assert_fast_failure(idx, hasher)
        with pytest.raises(ResidencyUnavailable):
            await idx.apply(A, batch(eng.stored(TOKENS, 2, 5)))
        own_redis.start()  # a fresh server: no persistence, everything is gone
        await idx.apply(A, batch(eng.removed(TOKENS, [4])))
        # The resync rewrote what the engine-hash map knows: blocks 0-3.
        assert await idx.match(hasher.hash_tokens(TOKENS)) == {A: full(4)}
    finally:
        await idx.close()


async def test_retired_slots_are_swept_then_reused(redis_url: str, hasher: BlockHasher) -> None:
    idx = redis_index(redis_url, hasher, max_node_slots=26)
    eng = FakeEngine()
    many = [NodeId(f"n{i:02d}") for i in range(26)]
    hashes = hasher.hash_tokens(TOKENS)
    try:
        for node in many:
            await idx.apply(node, batch(eng.stored(TOKENS, 0, 2)))
        late = NodeId("late")
        with pytest.raises(ResidencyUnavailable, match="NOSLOT"):
            await idx.apply(late, batch(eng.stored(TOKENS, 0, 3)))
        for node in many[:3]:
            await idx.forget(node)
        assert set(await idx.match(hashes)) == set(many[3:])  # retired bits are invisible
        # The refused node's next apply resyncs from its map; a slot is free only after a sweep.
        with pytest.raises(ResidencyUnavailable, match="NOSLOT"):
            await idx.apply(late, batch())
        assert await idx.sweep() == 3
        await idx.apply(late, batch())
        result = await idx.match(hashes)
        assert result[late] == full(3)
        assert set(result) == {late, *many[3:]}
        client = Redis.from_url(redis_url)
        try:
            live = {int(s) for s in await client.hvals(idx.keys.slots)}
            for h in hashes[:3]:
                held = holders(await client.hget(idx.keys.res, block_id(h)))
                assert held and set(held) <= live  # retired slots were scrubbed
        finally:
            await client.aclose()
    finally:
        await idx.close()


async def test_forgets_start_a_background_sweep(redis_url: str, hasher: BlockHasher) -> None:
    idx = redis_index(redis_url, hasher)
    eng = FakeEngine()
    try:
        nodes = [NodeId(f"n{i}") for i in range(RedisIndex.SWEEP_AFTER_RETIRED)]
        for node in nodes:
            await idx.apply(node, batch(eng.stored(TOKENS, 0, 2)))
        for node in nodes:
            await idx.forget(node)
        async with asyncio.timeout(5):
            while idx.sweeps == 0:
                await asyncio.sleep(0.01)
        client = Redis.from_url(redis_url)
        try:
            assert await client.scard(idx.keys.retired) == 0
            assert not await client.hexists(idx.keys.res, block_id(hasher.hash_tokens(TOKENS)[0]))
        finally:
            await client.aclose()
    finally:
        await idx.close()

"""Index exactness from real KV event streams (ZMQ, the subscriber's gap replay and resets),
then in the router: the discount, the explain rows and the gauge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import NodeId
from pdproxy.routing.kv.event_feeds import EventFeeds
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.scorers.index_exactness import (
    Exactness,
    IndexExactness,
    IndexExactnessScorer,
)
from pdproxy.routing.kv.state import LocalState
from pdproxy.routing.kv.telemetry import KvRouterMetrics
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import IndexExactnessSettings
from pdproxy.tokenize.base import OffLoopTokenizer
from pdproxy.tokenize.byte_level import ByteEncoder

from .kv_helpers import BS, HASHER, SEED, pool, prompt_text, removed, stored, text_request
from .lossy_publisher import LossyPublisher

X = prompt_text(1, 512)
Y = prompt_text(2, 512)
EXACTNESS = IndexExactnessSettings(silence_s=0.3, settle_s=0.2)


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        if loop.time() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.02)


class Feed:
    def __init__(self, pub: LossyPublisher) -> None:
        self.pub = pub
        self.index = MemoryIndex(HASHER)
        self.exactness = IndexExactness(EXACTNESS)
        self.feeds = EventFeeds(
            self.index, lambda: None, replay_timeout_s=30.0, exactness=self.exactness
        )

    def state(self) -> Exactness:
        return self.exactness.of("c0", asyncio.get_running_loop().time()).state

    async def held(self, text: str) -> int:
        m = (await self.index.match(HASHER.hash_tokens(list(text.encode())))).get(NodeId("c0"))
        return 0 if m is None else m.total

    async def seed(self, text: str) -> None:
        """Publish ``text``'s blocks until applied (PUB/SUB joins late; a missed first batch
        is a gap that the replay fills)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while await self.held(text) == 0:
            assert loop.time() < deadline, "events never arrived"
            await self.pub.publish(stored(text))
            await asyncio.sleep(0.05)
        await until(lambda: self.state() is Exactness.EXACT)


@pytest.fixture
async def feed() -> AsyncIterator[Feed]:
    pub = LossyPublisher()
    f = Feed(pub)
    await f.feeds.subscribe("c0", pub.endpoint, pub.replay_endpoint)
    try:
        yield f
    finally:
        await f.feeds.close()
        await pub.close()


async def test_gap_is_degraded_while_replayed_then_exact(feed: Feed) -> None:
    await feed.seed(X)
    feed.pub.replays_open.clear()
    await feed.pub.publish(removed(X), live=False)  # lost in transit, still in the buffer
    await feed.pub.publish(stored(Y))  # reveals the gap
    await until(lambda: feed.state() is Exactness.DEGRADED)
    assert await feed.held(X) > 0  # the over-estimate the discount is for
    feed.pub.replays_open.set()
    await until(lambda: feed.state() is Exactness.EXACT)
    assert await feed.held(X) == 0 and await feed.held(Y) > 0


async def test_events_lost_for_good_are_stale_until_the_stream_settles(feed: Feed) -> None:
    await feed.seed(X)
    await feed.pub.publish(removed(X), live=False, keep=False)  # gone for good
    await feed.pub.publish(stored(Y))
    await until(lambda: feed.state() is Exactness.STALE)
    assert feed.exactness.of("c0", asyncio.get_running_loop().time()).reason == "lost"
    await asyncio.sleep(EXACTNESS.settle_s)
    await feed.pub.publish(stored(Y))
    await until(lambda: feed.state() is Exactness.EXACT)


async def test_silence_after_work_is_stale_and_late_events_clear_it(feed: Feed) -> None:
    await feed.seed(X)
    feed.exactness.expect("c0", asyncio.get_running_loop().time())
    await until(lambda: feed.state() is Exactness.STALE)
    await feed.pub.publish(stored(Y))
    await until(lambda: feed.state() is Exactness.EXACT)


async def test_a_stale_node_is_discounted_explained_and_exported() -> None:
    """c0 holds the prompt's prefix but is busier; trusted, it wins on its cache; stale, its
    match is not credited and the idle c1 wins."""
    settings = KvRouterSettings(model_seed=SEED, block_size=BS, index_exactness=EXACTNESS)
    router = KvRouter(
        settings,
        state=LocalState(MemoryIndex(HASHER)),
        tokenizer=OffLoopTokenizer(ByteEncoder(), 16_384),  # type: ignore[arg-type]
        metrics=KvRouterMetrics(CollectorRegistry()),
    )
    await router.start()
    try:
        _, cons = pool(0, 2)
        long, short = prompt_text(3, 2048), prompt_text(4, 48)
        await router.state.index.apply(NodeId("c0"), stored(long))
        busy = await router.route(text_request(short), [], cons)  # charges c0 (a tie by name)
        assert busy.consumers[0].name == "c0"
        now = asyncio.get_running_loop().time()
        ex = router.scorer(IndexExactnessScorer).exactness
        ex.track("c0", now)
        ex.track("c1", now)
        trusted = await router.route(text_request(long + "tail"), [], cons)
        assert trusted.consumers[0].name == "c0"
        assert trusted.explain["consumers"][0]["exactness"] == "exact"
        ex.lost("c0", now)
        decision = await router.route(text_request(long + "tail"), [], cons)
        assert decision.consumers[0].name == "c1"
        rows = {r["name"]: r for r in decision.explain["consumers"]}
        assert rows["c0"]["exactness"] == "stale" and rows["c0"]["total"] > 0
        gauge = router.metrics.registry.get_sample_value
        assert gauge("pdproxy_kv_index_exactness", {"node": "c0"}) == 2.0
        assert gauge("pdproxy_kv_index_exactness", {"node": "c1"}) == 0.0
    finally:
        await router.close()

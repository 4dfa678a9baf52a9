"""The KV-aware router over the in-memory index: prefix affinity, predictions, eviction,
conditional disaggregation, load accounting, explainability, unhashable requests."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import NodeId
from pdproxy.errors import NoBackendAvailable
from pdproxy.routing.base import RequestOutcome, RouteRequest
from pdproxy.routing.explain_header import route_explain_value
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.state import LocalState, NodeLoad
from pdproxy.routing.kv.telemetry import KvRouterMetrics
from pdproxy.settings.routing import KvRouterSettings, LocalPrefillThresholds
from pdproxy.settings.scorers import CostWeights
from pdproxy.tokenize.base import OffLoopTokenizer
from pdproxy.tokenize.byte_level import ByteEncoder
from pdproxy.tokenize.remote import BackendTokenizer

from .kv_helpers import BS, SEED, pool, prompt_text, removed, stored, text_request

SETTINGS = KvRouterSettings(model_seed=SEED, block_size=BS)
ALWAYS_PD = SETTINGS.model_copy(
    update={"local_prefill": LocalPrefillThresholds(max_suffix_tokens=0, min_hit_ratio=1.0)}
)


def make_router(settings: KvRouterSettings = SETTINGS, tokenizer: object = None) -> KvRouter:
    return KvRouter(
        settings,
        state=LocalState(MemoryIndex(BlockHasher(settings.model_seed, settings.block_size))),
        tokenizer=tokenizer or OffLoopTokenizer(ByteEncoder(), 16_384),  # type: ignore[arg-type]
        metrics=KvRouterMetrics(CollectorRegistry()),
    )


@pytest.fixture
async def router() -> AsyncIterator[KvRouter]:
    r = make_router()
    await r.start()
    try:
        yield r
    finally:
        await r.close()


def sample(router: KvRouter, name: str, labels: dict[str, str] | None = None) -> float:
    value = router.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def test_second_request_sharing_a_prefix_goes_to_the_holder(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    prefix = prompt_text(1)
    await router.state.index.apply(NodeId("p1"), stored(prefix))
    d = await router.route(text_request(prefix + " question A"), producers, consumers)
    assert [b.name for b in d.producers] == ["p1", "p0"]
    assert d.reason == "kv-prefix"
    p1 = d.explain["producers"][0]
    assert p1["name"] == "p1" and p1["gpu"] == 128 and p1["total"] == 128
    assert d.prompt_tokens == len(prefix) + len(" question A")
    assert d.route_time_s > 0


async def test_routing_follows_eviction_events() -> None:
    router = make_router(ALWAYS_PD.model_copy(update={"prediction_ttl_s": 0.05}))
    producers, consumers = pool(2, 1)
    prefix = prompt_text(2)
    try:
        await router.state.index.apply(NodeId("p1"), stored(prefix))
        d = await router.route(text_request(prefix + "x"), producers, consumers)
        await router.finished(d, RequestOutcome("p1", "c0", ok=True))
        assert d.producers[0].name == "p1"
        await router.state.index.apply(NodeId("p1"), removed(prefix))
        await asyncio.sleep(0.06)  # the decision's own prediction on p1 expires
        d = await router.route(text_request(prefix + "y"), producers, consumers)
        assert d.producers[0].name == "p0" and d.reason == "load"
        # And back when p1 stores it again.
        await router.finished(d, RequestOutcome("p0", "c0", ok=True))
        await router.state.index.apply(NodeId("p1"), stored(prefix, "CPU"))
        await asyncio.sleep(0.06)
        d = await router.route(text_request(prefix + "z"), producers, consumers)
        assert d.producers[0].name == "p1" and d.reason == "kv-prefix"
    finally:
        await router.close()


async def test_host_tier_counts_less_than_gpu(router: KvRouter) -> None:
    producers, consumers = pool(2, 1)
    prefix = prompt_text(3)
    await router.state.index.apply(NodeId("p0"), stored(prefix, "CPU"))
    await router.state.index.apply(NodeId("p1"), stored(prefix, "GPU"))
    d = await router.route(text_request(prefix + "z"), producers, consumers)
    assert d.producers[0].name == "p1"
    rows = {r["name"]: r for r in d.explain["producers"]}
    assert rows["p0"]["cpu"] == 128 and rows["p0"]["gpu"] == 0
    assert rows["p0"]["cost"] > rows["p1"]["cost"]


async def test_prediction_lets_siblings_follow_before_events() -> None:
    # Load free and always disaggregated, so only residency (here: predictions) decides.
    settings = ALWAYS_PD.model_copy(
        update={"weights": CostWeights(in_flight_tokens=0, queued_token_weight=0)}
    )
    router = make_router(settings)
    producers, consumers = pool(4, 2)
    prefix = prompt_text(4)
    try:
        first = await router.route(text_request(prefix + "a"), producers, consumers)
        chosen = first.producers[0].name
        for i in range(5):
            sib = await router.route(text_request(prefix + f"sibling {i}"), producers, consumers)
            assert sib.producers[0].name == chosen
            row = next(r for r in sib.explain["producers"] if r["name"] == chosen)
            assert row["predicted"] == 128 and row["total"] == 0
            assert sib.consumers[0].name == first.consumers[0].name
    finally:
        await router.close()


async def test_consumer_that_received_a_prefix_serves_siblings_alone(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    prefix = prompt_text(13)
    first = await router.route(text_request(prefix + "a"), producers, consumers)
    assert first.producers  # cold: disaggregated
    sib = await router.route(text_request(prefix + "b"), producers, consumers)
    # The consumer fetched every block of the first request: the sibling's suffix is short.
    assert sib.consumers[0].name == first.consumers[0].name
    assert sib.producers == [] and sib.reason == "short-suffix"


async def test_load_spreads_identical_cold_requests(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    decisions = [
        await router.route(text_request(prompt_text(10 + i)), producers, consumers)
        for i in range(4)
    ]
    assert sorted(d.producers[0].name for d in decisions) == ["p0", "p0", "p1", "p1"]
    assert sorted(d.consumers[0].name for d in decisions) == ["c0", "c0", "c1", "c1"]
    for d in decisions:
        await router.finished(d, RequestOutcome(d.producers[0].name, d.consumers[0].name, True))
    assert router.state.local.snapshot() == {
        n: router.state.local.get("none") for n in router.state.local.snapshot()
    }


async def test_overloaded_holder_is_passed_over_by_hot_spot_guard() -> None:
    settings = SETTINGS.model_copy(
        update={"hotspot_max_imbalance": 2, "weights": CostWeights(in_flight_tokens=1.0)}
    )
    router = make_router(settings.model_copy(update={"local_prefill": ALWAYS_PD.local_prefill}))
    producers, consumers = pool(2, 1)
    prefix = prompt_text(5)
    await router.state.index.apply(NodeId("p0"), stored(prefix))
    try:
        chosen = [
            (await router.route(text_request(prefix + str(i)), producers, consumers))
            .producers[0]
            .name
            for i in range(6)
        ]
    finally:
        await router.close()
    # The holder takes requests until it is 2 ahead of p1, then p1 gets one, and so on.
    assert chosen[:3] == ["p0", "p0", "p0"]
    assert "p1" in chosen
    assert sample(router, "pdproxy_kv_router_decisions_total", {"reason": "hot-spot"}) >= 1


async def test_short_prompt_goes_to_consumer_alone(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    d = await router.route(text_request("hello there"), producers, consumers)
    assert d.producers == [] and d.reason == "short-suffix"


async def test_consumer_holding_the_prefix_prefills_alone(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    prefix = prompt_text(6, length=4096)
    await router.state.index.apply(NodeId("c1"), stored(prefix))
    d = await router.route(text_request(prefix + "tail"), producers, consumers)
    assert d.consumers[0].name == "c1" and d.producers == []
    assert d.reason in ("short-suffix", "consumer-holds-prefix")
    assert d.predicted_cached_tokens == 4096


async def test_unhashable_requests_route_by_load(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
        ],
    }
    d = await router.route(RouteRequest(uuid.uuid4().hex, "chat", body), producers, consumers)
    assert d.reason == "load-only" and d.predicted_cached_tokens is None
    assert d.explain["unhashable"] == "multimodal"
    assert sample(router, "pdproxy_kv_router_unhashable_total", {"reason": "multimodal"}) == 1
    assert d.producers  # load-only still disaggregates


async def test_tokenizer_failure_routes_by_load() -> None:
    router = make_router(tokenizer=BackendTokenizer("http://127.0.0.1:9", None, 0.2))
    producers, consumers = pool(1, 1)
    try:
        d = await router.route(text_request("x" * 5000), producers, consumers)
    finally:
        await router.close()
    assert d.reason == "load-only" and d.explain["unhashable"] == "tokenizer-error"


async def test_no_consumer_raises(router: KvRouter) -> None:
    # Routable or not is the filter chain's (test_candidates.py): it runs once, before routing.
    producers, _ = pool(1, 2)
    with pytest.raises(NoBackendAvailable):
        await router.route(text_request("hi"), producers, [])
    d = await router.route(text_request(prompt_text(7)), [], pool(0, 2)[1][1:])
    assert [c.name for c in d.consumers] == ["c1"] and d.producers == []


async def test_finished_releases_load_and_records_drift(router: KvRouter) -> None:
    producers, consumers = pool(1, 1)
    prefix = prompt_text(8, length=1024)
    await router.state.index.apply(NodeId("c0"), stored(prefix))
    d = await router.route(text_request(prefix + "abc"), producers, consumers)
    assert d.producers == [] and d.predicted_cached_tokens == 1024
    assert router.state.local.get("c0") == NodeLoad(1, 3)
    await router.finished(d, RequestOutcome(None, "c0", ok=True, cached_tokens=992))
    assert router.state.local.get("c0") == NodeLoad(0, 0)
    labels = {"mode": "alone"}
    assert sample(router, "pdproxy_kv_router_cached_tokens_drift_count", labels) == 1
    # 992 reported - 1024 predicted = -32 (the histogram has no _sum: it has negative buckets).
    bucket = "pdproxy_kv_router_cached_tokens_drift_bucket"
    assert sample(router, bucket, {**labels, "le": "-32.0"}) == 1
    assert sample(router, bucket, {**labels, "le": "-128.0"}) == 0
    # Exactly once per decision: a second call changes nothing and does not raise.
    await router.finished(d, RequestOutcome(None, "c0", ok=True, cached_tokens=992))
    assert router.state.local.get("c0").in_flight == 0
    assert sample(router, "pdproxy_kv_router_cached_tokens_drift_count", labels) == 1


async def test_debug_log_line_explains_the_decision(
    router: KvRouter, caplog: pytest.LogCaptureFixture
) -> None:
    producers, consumers = pool(2, 1)
    with caplog.at_level(logging.DEBUG, logger="pdproxy.routing.kv.router"):
        await router.route(text_request(prompt_text(9), rid="req-42"), producers, consumers)
    line = next(r.getMessage() for r in caplog.records if "req-42" in r.getMessage())
    assert "consumer=c0" in line and "producer=p0" in line and "'cost'" in line


async def test_token_id_prompts_match_text_prompts(router: KvRouter) -> None:
    producers, consumers = pool(2, 1)
    prefix = prompt_text(11)
    await router.state.index.apply(NodeId("p1"), stored(prefix))
    ids = list((prefix + "?").encode())
    d = await router.route(
        RouteRequest(uuid.uuid4().hex, "completions", {"prompt": ids}), producers, consumers
    )
    assert d.producers[0].name == "p1"


async def test_chat_requests_hash_the_rendered_template(router: KvRouter) -> None:
    producers, consumers = pool(2, 1)
    system = prompt_text(12)
    rendered = f"<|system|>\n{system}\n<|user|>\nhi\n<|assistant|>\n"
    await router.state.index.apply(NodeId("p1"), stored(rendered))
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    d = await router.route(RouteRequest(uuid.uuid4().hex, "chat", body), producers, consumers)
    assert d.producers[0].name == "p1"
    assert d.explain["producers"][0]["total"] == len(rendered) // BS


@pytest.mark.parametrize("bad", [[1, -2, 3], [2**32], [1, "x"], [1, 1.5]])
async def test_invalid_token_ids_route_by_load(router: KvRouter, bad: list[object]) -> None:
    producers, consumers = pool(1, 1)
    d = await router.route(
        RouteRequest(uuid.uuid4().hex, "completions", {"prompt": bad}), producers, consumers
    )
    assert d.reason == "load-only" and d.explain["unhashable"] == "invalid-tokens"


class BrokenIndex(MemoryIndex):
    """An index with a bug: match raises something no one planned for."""

    async def match(self, hashes: object) -> dict[NodeId, object]:  # type: ignore[override]
        raise RuntimeError("index bug")


async def test_unexpected_index_failure_routes_by_load() -> None:
    router = KvRouter(
        SETTINGS,
        state=LocalState(BrokenIndex(BlockHasher(SEED, BS))),
        tokenizer=OffLoopTokenizer(ByteEncoder(), 16_384),
        metrics=KvRouterMetrics(CollectorRegistry()),
    )
    producers, consumers = pool(2, 2)
    try:
        d = await router.route(text_request(prompt_text(14)), producers, consumers)
        assert d.reason == "load-only" and d.explain["index"] == "fallback"
        assert d.producers and d.consumers
        await router.finished(d, RequestOutcome(None, None, ok=False))
        assert router.state.local.get(d.consumers[0].name).in_flight == 0
    finally:
        await router.close()


async def test_debug_header_is_compact_ascii_json(router: KvRouter) -> None:
    producers, consumers = pool(8, 8)
    d = await router.route(text_request(prompt_text(15)), producers, consumers)
    full = json.loads(route_explain_value(d))
    assert full["reason"] == d.reason and len(full["producers"]) == 8
    small = route_explain_value(d, max_bytes=700)
    assert len(small) <= 700 and small.isascii()
    assert len(json.loads(small)["producers"]) < 8


async def test_routing_work_is_capped_to_a_prefix() -> None:
    """A huge prompt is hashed, matched and predicted only over ``max_route_blocks`` blocks;
    its full length still counts as load."""
    settings = ALWAYS_PD.model_copy(update={"max_route_blocks": 4, "inline_hash_blocks": 2})
    router = make_router(settings)
    producers, consumers = pool(2, 1)
    long_text = prompt_text(40)
    try:
        await router.state.index.apply(NodeId("p1"), stored(long_text))
        d = await router.route(text_request(long_text), producers, consumers)
    finally:
        await router.close()
    assert d.explain["blocks"] == 4
    assert d.explain["prompt_tokens"] == len(long_text.encode())
    assert d.producers[0].name == "p1"  # the capped prefix still finds the holder
    assert sample(router, "pdproxy_kv_router_offloaded_hashes_total") == 1.0


async def test_decision_ranks_the_objects_it_was_given(router: KvRouter) -> None:
    producers, consumers = pool(2, 2)
    d = await router.route(text_request(prompt_text(10)), producers, consumers)
    assert all(any(b is p for p in producers) for b in d.producers)
    assert all(any(b is c for c in consumers) for b in d.consumers)


async def test_predictions_of_both_legs_are_checked_against_the_engines(
    router: KvRouter, caplog: pytest.LogCaptureFixture
) -> None:
    """The producer's prediction (what it holds) beside its answer's cached_tokens, and the
    consumer's; each counted exact / within a block / off; an off one logged."""
    producers, consumers = pool(2, 1)
    prefix = prompt_text(10, length=1024)
    await router.state.index.apply(NodeId("p1"), stored(prefix))
    d = await router.route(text_request(prefix + "x" * 600), producers, consumers)
    assert d.producers[0].name == "p1"
    # The consumer gets every full block over KV transfer (pd_cached_tokens: transferred).
    assert (d.predicted_producer_cached_tokens, d.predicted_cached_tokens) == (1024, 1616)
    assert d.explain["predicted_producer_cached_tokens"] == 1024
    with caplog.at_level(logging.INFO, logger="pdproxy.routing.kv.router"):
        await router.finished(
            d,
            RequestOutcome(
                "p1", "c0", ok=True, cached_tokens=1616 - BS // 2, producer_cached_tokens=1024
            ),
        )
    checks = "pdproxy_kv_router_prediction_checks_total"
    assert sample(router, checks, {"leg": "producer", "result": "exact"}) == 1
    assert sample(router, checks, {"leg": "consumer", "result": "block"}) == 1
    assert sample(router, "pdproxy_kv_router_cached_tokens_drift_count", {"mode": "producer"}) == 1
    assert not [r for r in caplog.records if "engine reported" in r.getMessage()]
    # A retry's producer was not predicted: nothing is checked for it; an off consumer is logged.
    d = await router.route(text_request(prefix + "y" * 600), producers, consumers)
    with caplog.at_level(logging.INFO, logger="pdproxy.routing.kv.router"):
        await router.finished(
            d, RequestOutcome("p0", "c0", ok=True, cached_tokens=1024, producer_cached_tokens=0)
        )
    assert sample(router, checks, {"leg": "producer", "result": "off"}) in (None, 0)
    assert sample(router, checks, {"leg": "consumer", "result": "off"}) == 1
    line = next(r.getMessage() for r in caplog.records if "engine reported" in r.getMessage())
    assert "consumer c0 predicted" in line and "reported 1024" in line

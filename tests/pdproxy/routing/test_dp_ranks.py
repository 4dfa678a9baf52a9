"""Data-parallel ranks: node identity, vLLM's port conventions, the rank gate on event batches,
and the rank-aware router wrapper over the KV router and the load-only routers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvtier.events import EventBatch, EventPublisher
from kvtier.events.ranks import offset_endpoint
from kvtier.residency.types import NodeId
from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.dp_ranks import (
    DP_RANK_HEADER,
    batch_rank_refused,
    node_rank,
    offset_port,
    rank_node,
    rank_streams,
    with_rank_header,
)
from pdproxy.routing.base import RequestOutcome, Role
from pdproxy.routing.dp_router import DpRankMetrics, DpRankRouter
from pdproxy.routing.factory import build_router, routes_ranks
from pdproxy.routing.kv.build import RegistryEventSource, build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.simple import LeastLoadedRouter, RoundRobinRouter
from pdproxy.settings import BackendConfig, BreakerSettings, ProxySettings
from pdproxy.settings.routing import KvRouterSettings

from .kv_helpers import BS, HASHER, SEED, prompt_text, stored, text_request

NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


# ------------------------------------------------------------------ identity and ports


@given(NAMES, st.integers(0, 1023))
def test_rank_node_round_trips_and_rank_zero_is_the_backend(name: str, rank: int) -> None:
    node = rank_node(name, rank)
    assert node_rank(node) == (name, rank)
    if rank == 0:
        assert node == name  # a DP=1 backend is exactly today's node


@given(NAMES, NAMES, st.integers(1, 64), st.integers(1, 64))
def test_rank_nodes_never_collide_with_backends_or_other_ranks(
    a: str, b: str, ra: int, rb: int
) -> None:
    assert rank_node(a, ra) != b  # '#' is not allowed in backend names
    if (a, ra) != (b, rb):
        assert rank_node(a, ra) != rank_node(b, rb)


def test_plain_names_parse_as_rank_zero() -> None:
    assert node_rank("p0") == ("p0", 0)
    assert node_rank("x#dp0") == ("x#dp0", 0)  # rank 0 is never spelled with a suffix
    assert node_rank("x#dpa") == ("x#dpa", 0)
    assert node_rank("x#dp²") == ("x#dp²", 0)  # configured event node names are free text
    with pytest.raises(ValueError):
        rank_node("x", -1)


def test_ports_offset_by_rank_as_vllm_does() -> None:
    assert offset_port(("h", 7000), None) == ("h", 7000)
    assert offset_port(("h", 7000), 0) == ("h", 7000)
    assert offset_port(("h", 7000), 3) == ("h", 7003)
    assert offset_port(None, 2) is None
    assert offset_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    assert offset_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert offset_endpoint(None, 4) is None
    for bad in ("tcp://host", "udp://h:1"):
        with pytest.raises(ValueError):
            offset_endpoint(bad, 1)
    with pytest.raises(ValueError):
        offset_endpoint("tcp://h:65535", 1)


def test_rank_streams_follow_each_ranks_socket() -> None:
    assert rank_streams("w", 1, "tcp://h:5557", None) == [(NodeId("w"), "tcp://h:5557", None)]
    assert rank_streams("w", 3, "tcp://h:5557", "tcp://h:6000") == [
        (NodeId("w"), "tcp://h:5557", "tcp://h:6000"),
        (NodeId("w#dp1"), "tcp://h:5558", "tcp://h:6001"),
        (NodeId("w#dp2"), "tcp://h:5559", "tcp://h:6002"),
    ]


def test_the_registry_follows_one_event_stream_per_rank() -> None:
    registry = BackendRegistry(BreakerSettings())
    registry.add(BackendConfig(name="a", url="http://h:1", role=Role.BOTH,
                               events_endpoint="tcp://h:5557"))  # fmt: skip
    registry.add(BackendConfig(name="b", url="http://h:2", role=Role.BOTH, data_parallel_size=2,
                               events_endpoint="tcp://h:6000",
                               events_replay_endpoint="tcp://h:6100"))  # fmt: skip
    ranked = RegistryEventSource(registry, ranks=True).all()
    assert [(e.name, e.events_endpoint, e.events_replay_endpoint) for e in ranked] == [
        ("a", "tcp://h:5557", None),
        ("b", "tcp://h:6000", "tcp://h:6100"),
        ("b#dp1", "tcp://h:6001", "tcp://h:6101"),
    ]
    blind = RegistryEventSource(registry).all()  # rank-blind: one stream per backend, as before
    assert [e.name for e in blind] == ["a", "b"]


def test_auto_wraps_the_router_only_when_a_backend_has_ranks() -> None:
    one = {"name": "a", "url": "http://h:1", "role": "both"}
    two = {**one, "name": "b", "data_parallel_size": 2}
    assert not routes_ranks(ProxySettings(backends=[one]))
    assert routes_ranks(ProxySettings(backends=[one, two]))
    assert not routes_ranks(ProxySettings(backends=[two], data_parallel_routing="off"))
    assert routes_ranks(ProxySettings(backends=[one], data_parallel_routing="on"))
    assert isinstance(build_router(ProxySettings(backends=[one, two])), DpRankRouter)
    assert isinstance(build_router(ProxySettings(backends=[one])), RoundRobinRouter)


def test_rank_header_only_when_a_rank_was_chosen() -> None:
    assert with_rank_header({"a": "b"}, None) == {"a": "b"}
    assert with_rank_header({}, 0) == {DP_RANK_HEADER: "0"}
    assert with_rank_header({}, 5) == {DP_RANK_HEADER: "5"}


def test_backend_config_validates_rank_ports() -> None:
    base = {"name": "w", "url": "http://h:1", "role": "both"}
    assert BackendConfig(**base).data_parallel_size == 1
    assert BackendConfig(**base, data_parallel_size=4, kv_address="h:65532").data_parallel_size == 4
    with pytest.raises(ValueError, match="kv_address"):
        BackendConfig(**base, data_parallel_size=4, kv_address="h:65533")
    with pytest.raises(ValueError, match="offset"):
        BackendConfig(**base, data_parallel_size=2, events_endpoint="tcp://h")
    with pytest.raises(ValueError):
        BackendConfig(**base, data_parallel_size=0)


@given(st.integers(0, 8), st.none() | st.integers(-3, 100))
def test_a_batch_is_applied_only_to_its_sockets_rank(rank: int, tagged: int | None) -> None:
    batch = EventBatch(0.0, (), tagged)
    refused = batch_rank_refused(rank_node("w", rank), batch)
    assert refused == (tagged is not None and tagged != rank)


# ------------------------------------------------------------------ the router wrapper


@dataclass
class RankedBackend:
    name: str
    role: Role
    data_parallel_size: int = 1
    url: str = "http://127.0.0.1:9"
    routable: bool = True
    in_flight: int = 0


def kv_settings(**extra: object) -> KvRouterSettings:
    return KvRouterSettings.model_validate(
        {"model_seed": SEED, "block_size": BS, "prediction_ttl_s": 0.001, **extra}
    )


async def test_dp1_backends_decide_exactly_as_the_wrapped_router() -> None:
    backends = [RankedBackend("a", Role.CONSUMER), RankedBackend("b", Role.CONSUMER)]
    plain, wrapped = RoundRobinRouter(), DpRankRouter(RoundRobinRouter())
    for i in range(4):
        d0 = await plain.route(text_request(f"x{i}"), [], backends)
        d1 = await wrapped.route(text_request(f"x{i}"), [], backends)
        assert [b.name for b in d1.consumers] == [b.name for b in d0.consumers]
        assert d1.consumers[0] is d0.consumers[0]  # the very objects given
        assert d1.consumer_ranks == {} and d1.producer_ranks == {}
        await wrapped.finished(d1, RequestOutcome(None, d1.consumers[0].name, True))


async def test_round_robin_walks_ranks_and_collapses_to_backends() -> None:
    a = RankedBackend("a", Role.CONSUMER, data_parallel_size=2)
    b = RankedBackend("b", Role.CONSUMER)
    router = DpRankRouter(RoundRobinRouter())
    chosen = []
    for i in range(3):
        d = await router.route(text_request(f"x{i}"), [], [a, b])
        assert sorted(x.name for x in d.consumers) == ["a", "b"]  # each backend once
        first = d.consumers[0]
        chosen.append((first.name, d.consumer_ranks.get(first.name)))
        await router.finished(d, RequestOutcome(None, first.name, True))
    assert chosen == [("a", 0), ("a", 1), ("b", None)]


async def test_least_loaded_counts_requests_per_rank() -> None:
    a = RankedBackend("a", Role.CONSUMER, data_parallel_size=3)
    registry = CollectorRegistry()
    router = DpRankRouter(LeastLoadedRouter(), DpRankMetrics(registry))
    held = [await router.route(text_request(f"x{i}"), [], [a]) for i in range(3)]
    assert sorted(d.consumer_ranks["a"] for d in held) == [0, 1, 2]
    for d in held:
        await router.finished(d, RequestOutcome(None, "a", True))
    for r in range(3):
        value = registry.get_sample_value(
            "pdproxy_dp_rank_routed_total", {"backend": "a", "rank": str(r), "role": "consumer"}
        )
        assert value == 1.0
    assert router._load == {}  # every charge released


async def test_kv_router_places_a_prefix_on_the_rank_that_holds_it() -> None:
    inner = build_kv_router(kv_settings(), metrics_registry=CollectorRegistry())
    router = DpRankRouter(inner)
    a = RankedBackend("a", Role.CONSUMER, data_parallel_size=2)
    b = RankedBackend("b", Role.CONSUMER, data_parallel_size=2)
    text = prompt_text(1, 512)
    await inner.state.index.apply(rank_node("b", 1), stored(text))
    d = await router.route(text_request(text), [], [a, b])
    assert d.consumers[0] is b and d.consumer_ranks["b"] == 1
    assert d.explain["consumer_rank"] == 1
    assert d.explain["consumers"][0]["name"] == "b#dp1"
    # rank 0 of b holds nothing: events of rank 1 did not mark it.
    matches = await inner.state.index.match(HASHER.hash_tokens(list(text.encode())))
    assert NodeId("b") not in matches and matches[NodeId("b#dp1")].gpu > 0
    await router.finished(d, RequestOutcome(None, "b", True, cached_tokens=496))
    assert isinstance(router.inner, KvRouter)
    await router.close()


async def test_the_producer_rank_holding_the_prefix_prefills_for_any_consumer_rank() -> None:
    inner = build_kv_router(
        kv_settings(local_prefill={"max_suffix_tokens": 0, "min_hit_ratio": 1.0}),
        metrics_registry=CollectorRegistry(),
    )
    router = DpRankRouter(inner)
    p = RankedBackend("p", Role.PRODUCER, data_parallel_size=2)
    c = RankedBackend("c", Role.CONSUMER, data_parallel_size=2)
    text = prompt_text(2, 512)
    await inner.state.index.apply(rank_node("p", 1), stored(text))
    d = await router.route(text_request(text), [p], [c])
    assert d.producers == [p] and d.consumers == [c]
    assert d.producer_ranks == {"p": 1} and d.consumer_ranks == {"c": 0}
    assert d.explain["producer_rank"] == 1
    await router.finished(d, RequestOutcome("p", "c", True))
    assert router._load == {}
    await router.close()


# ------------------------------------------------------------------ the attacker


async def test_a_publisher_tagging_another_rank_is_refused_and_counted() -> None:
    """A worker (or whoever took its events socket) publishes batches tagged with a rank that
    is not its socket's: out of range (7) on rank 0's socket, rank 0 on rank 1's. Nothing is
    applied to any node; each batch is counted."""
    registry = CollectorRegistry()
    liars = [
        EventPublisher("tcp://127.0.0.1:*", data_parallel_rank=7),
        EventPublisher("tcp://127.0.0.1:*", data_parallel_rank=0),
    ]
    honest = EventPublisher("tcp://127.0.0.1:*", data_parallel_rank=1)
    for pub in (*liars, honest):
        await pub.start()
    router = build_kv_router(kv_settings(), metrics_registry=registry)
    try:
        await router.start()
        await router.feeds.subscribe("w", liars[0].endpoint, None)
        await router.feeds.subscribe("w#dp1", liars[1].endpoint, None)
        await router.feeds.subscribe("v#dp1", honest.endpoint, None)
        text = prompt_text(3, 256)
        hashes = HASHER.hash_tokens(list(text.encode()))

        def refused(node: str) -> float:
            value = registry.get_sample_value(
                "pdproxy_kv_router_events_rank_refused_total", {"node": node}
            )
            return value or 0.0

        deadline = asyncio.get_running_loop().time() + 5
        while True:
            for pub in (*liars, honest):
                await pub.publish(stored(text))
            matches = await router.state.index.match(hashes)
            if refused("w") and refused("w#dp1") and NodeId("v#dp1") in matches:
                break
            assert asyncio.get_running_loop().time() < deadline, "events never arrived"
            await asyncio.sleep(0.05)
        matches = await router.state.index.match(hashes)
        assert NodeId("w") not in matches and NodeId("w#dp1") not in matches
    finally:
        await router.close()
        for pub in (*liars, honest):
            await pub.close()

"""The KV router with predicted TTFT: the explanation shows it, a shed plan is refused before
anything is charged, and the leg timings the request path reports teach the rates."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry

from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from pdproxy.errors import Overloaded
from pdproxy.routing.base import RequestOutcome, RouteRequest
from pdproxy.routing.explain_header import route_explain_value
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.scorers.ttft import TtftScorer
from pdproxy.routing.kv.state import LocalState
from pdproxy.routing.kv.telemetry import KvRouterMetrics
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import TtftClass, TtftSettings
from pdproxy.tokenize.base import OffLoopTokenizer
from pdproxy.tokenize.byte_level import ByteEncoder

from ..kv_helpers import SEED, pool, prompt_text

SETTINGS = KvRouterSettings(
    model_seed=SEED,
    ttft=TtftSettings(
        classes={
            "interactive": TtftClass(target_ms=500.0),
            "batch": TtftClass(target_ms=2000.0, sheddable=True, yields=True),
        },
        warm_samples=2,
    ),
)


def make_router() -> KvRouter:
    return KvRouter(
        SETTINGS,
        state=LocalState(MemoryIndex(BlockHasher(SEED, SETTINGS.block_size))),
        tokenizer=OffLoopTokenizer(ByteEncoder(), 16_384),  # type: ignore[arg-type]
        metrics=KvRouterMetrics(CollectorRegistry()),
    )


def request(text: str, rid: str, ttft_class: str | None = None) -> RouteRequest:
    body = {"model": "m", "prompt": text, "stream": True}
    return RouteRequest(rid, "completions", body, ttft_class=ttft_class)


async def warm(router: KvRouter) -> None:
    """Streamed requests whose prefill took 0.1 ms per token (plus a little), on whichever
    node the router chose."""
    producers, consumers = pool(2, 2)
    for i in range(8):
        text = prompt_text(100 + i, 600 + 200 * (i % 4))
        d = await router.route(request(text, f"w{i}"), producers, consumers)
        prefill_s = (5 + 0.1 * len(text)) / 1e3
        consumer = d.consumers[0].name
        if d.producers:
            outcome = RequestOutcome(d.producers[0].name, consumer, True, producer_s=prefill_s,
                                     consumer_first_byte_s=0.02)  # fmt: skip
        else:
            outcome = RequestOutcome(None, consumer, True, consumer_first_byte_s=prefill_s)
        await router.finished(d, outcome)


async def test_warm_decisions_explain_their_prediction() -> None:
    router = make_router()
    await router.start()
    try:
        producers, consumers = pool(2, 2)
        cold = await router.route(request(prompt_text(1), "cold"), producers, consumers)
        assert "ttft" not in cold.explain  # cold: the cost model decided
        await router.finished(cold, RequestOutcome(None, None, False))
        await warm(router)
        d = await router.route(request(prompt_text(2), "r1"), producers, consumers)
        explained = json.loads(route_explain_value(d))
        assert explained["reason"].startswith("ttft")
        assert explained["ttft"]["class"] == "interactive"
        assert explained["ttft"]["target_ms"] == 500.0 and explained["ttft"]["met"]
        row = explained["producers"][0] if d.producers else explained["consumers"][0]
        assert row["ttft_ms"] > 0 and row["ms_per_token"] > 0
    finally:
        await router.close()


async def test_a_shed_batch_request_is_refused_and_charges_nothing() -> None:
    router = make_router()
    await router.start()
    try:
        await warm(router)
        scorer = router.scorer(TtftScorer)
        for node in ("p0", "p1", "c0", "c1"):
            scorer.rates.queue(node, 200_000, time.monotonic())  # every node far behind
        producers, consumers = pool(2, 2)
        text = prompt_text(3)
        loads_before = router.state.local.snapshot()
        with pytest.raises(Overloaded) as caught:
            await router.route(request(text, "b1", "batch"), producers, consumers)
        assert caught.value.status == 429
        assert int(caught.value.headers["retry-after"]) >= 1
        assert router.state.local.snapshot() == loads_before
        assert (
            router.metrics.registry.get_sample_value(
                "pdproxy_kv_router_ttft_shed_total", {"ttft_class": "batch"}
            )
            == 1.0
        )
        # An interactive request is never shed: it gets the best way, late as it is.
        d = await router.route(request(text, "i1", "interactive"), producers, consumers)
        assert d.consumers and d.explain["ttft"]["met"] is False
        await router.finished(d, RequestOutcome(None, None, False))
    finally:
        await router.close()


async def test_engine_readings_reach_the_backlog() -> None:
    from pdproxy.routing.kv.engine_metrics_text import EngineSample
    from pdproxy.routing.kv.scorers.engine_load import EngineLoadScorer, EngineReading
    from pdproxy.settings.scorers import EngineLoadSettings

    settings = SETTINGS.model_copy(update={"engine_load": EngineLoadSettings(enabled=True)})
    router = KvRouter(
        settings,
        state=LocalState(MemoryIndex(BlockHasher(SEED, SETTINGS.block_size))),
        tokenizer=OffLoopTokenizer(ByteEncoder(), 16_384),  # type: ignore[arg-type]
        metrics=KvRouterMetrics(CollectorRegistry()),
    )
    try:
        now = time.monotonic()
        router.scorer(EngineLoadScorer).readings.put(
            "p0", EngineReading(EngineSample(waiting=8, running=2, kv_usage=None), 0, now)
        )
        rates = router.scorer(TtftScorer).rates.snapshot(["p0", "p1"], now)
        assert rates["p0"].backlog_tokens > 0 and rates["p1"].backlog_tokens == 0
    finally:
        await router.close()

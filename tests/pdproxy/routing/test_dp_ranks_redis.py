"""Rank nodes in the shared (Redis) state: two proxy replicas, each wrapping its KV router in
the rank-aware router, agree on the rank that holds a prefix and share per-rank load. Rank 0
keeps the backend's own name, so a DP=1 backend's keys are the ones written before ranks."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.residency.types import NodeId
from pdproxy.fleet.dp_ranks import rank_node
from pdproxy.routing.base import RequestOutcome, Role
from pdproxy.routing.dp_router import DpRankRouter
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings

from .kv_helpers import BS, HASHER, SEED, prompt_text, stored, text_request
from .test_dp_ranks import RankedBackend

pytestmark = pytest.mark.redis


def settings_for(url: str) -> KvRouterSettings:
    return KvRouterSettings.model_validate(
        {"model_seed": SEED, "block_size": BS, "index_url": url, "redis_deadline_s": 0.05,
         "prediction_ttl_s": 0.001}
    )  # fmt: skip


async def test_replicas_agree_on_the_rank_and_share_its_load(
    redis_url: str, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    inner_a, inner_b = (
        router_factory(settings_for(redis_url)),
        router_factory(settings_for(redis_url)),
    )
    a, b = DpRankRouter(inner_a), DpRankRouter(inner_b)
    await a.start()
    await b.start()
    w = RankedBackend("w", Role.CONSUMER, data_parallel_size=2)
    v = RankedBackend("v", Role.CONSUMER)
    text = prompt_text(7, 512)
    node = rank_node("w", 1)
    leases = inner_a.state.leases
    assert leases is not None
    await leases.take(node)
    await leases.apply(node, stored(text), seq=0)
    da = await a.route(text_request(text), [], [w, v])
    db = await b.route(text_request(text), [], [w, v])
    assert da.explain["index"] == "redis"
    assert (da.consumers[0].name, da.consumer_ranks["w"]) == ("w", 1)
    assert (db.consumers[0].name, db.consumer_ranks["w"]) == ("w", 1)
    matches = await inner_b.state.index.match(HASHER.hash_tokens(list(text.encode())))
    assert NodeId("w") not in matches and matches[node].gpu > 0
    # b sees a's in-flight charge on w's rank 1 (the shared load is per rank node).
    loads = (await inner_b.state.observe(None, ["w", "w#dp1", "v"])).loads
    assert loads["w#dp1"].in_flight == 2 and loads["w"].in_flight == 0
    await a.finished(da, RequestOutcome(None, "w", True))
    await b.finished(db, RequestOutcome(None, "w", True))
    loads = (await inner_b.state.observe(None, ["w#dp1"])).loads
    assert loads["w#dp1"].in_flight == 0

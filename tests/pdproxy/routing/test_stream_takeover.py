"""One writer per worker event stream, across real proxy replicas sharing one Redis.

A ``pdproxy serve`` subprocess takes the worker's lease and writes its events; an in-process
replica follows the same stream without writing. The writer is killed with SIGKILL while the
worker keeps publishing (a removal of blocks the survivor never applied, and a new store): the
survivor takes the lease over once it expires, replays the gap from the worker's replay socket,
resolves the removal through the engine-hash map shared in Redis, and the residency is exactly
what the worker holds. Then a replica joins late, the survivor leaves cleanly, and the late one
takes over and resolves removals of blocks stored before it joined. Routing goes on throughout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from kvtier.events import EventBatch, EventPublisher
from kvtier.residency.redis_layout import ModelKeys
from kvtier.residency.types import Match, NodeId
from pdproxy.routing.base import RequestOutcome
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings
from tests.pdproxy.conftest import FakeFactory, backend_entry
from tests.reliability.procs import ProcessGroup

from .kv_helpers import BS, HASHER, SEED, pool, prompt_text, removed, stored, text_request
from .test_two_proxy_processes import procs, wait_healthy

__all__ = ["procs"]

pytestmark = [pytest.mark.slow, pytest.mark.redis]

W = NodeId("w0")
LEASE_TTL_S = 1.0
FULL = Match(gpu=128, cpu=0, total=128, predicted=128)  # prompt_text: 2,048 bytes = 128 blocks


def options(redis_url: str, pub: EventPublisher) -> dict[str, Any]:
    return {
        "model_seed": SEED,
        "block_size": BS,
        "index_url": redis_url,
        "redis_deadline_s": 1.0,  # this test is about writers, not deadlines
        "event_lease_ttl_s": LEASE_TTL_S,
        "events": {W: pub.endpoint},
        "replay": {W: pub.replay_endpoint},
    }


async def until(what: str, check: Callable[[], Awaitable[bool]], nudge: EventPublisher) -> None:
    """Wait (bounded) for ``check``; an empty batch now and then makes a subscriber that missed
    the last batch see the gap and replay it (PUB/SUB drops messages to late joiners)."""
    deadline = time.monotonic() + 20
    while not await check():
        assert time.monotonic() < deadline, f"never: {what}"
        await nudge.publish(EventBatch(0.0, ()))
        await asyncio.sleep(0.1)


async def residency(router: KvRouter, texts: list[str]) -> list[Match | None]:
    out = []
    for t in texts:
        m = await router.state.index.match(HASHER.hash_tokens(list(t.encode())))
        out.append(m.get(W))
    return out


async def traffic(
    routers: list[KvRouter], lock: asyncio.Lock, stop: asyncio.Event, done: list[int]
) -> None:
    """Decisions on every live replica until ``stop``; each one must answer. A replica leaves
    the list (under ``lock``) before it is closed."""
    producers, consumers = pool(1, 1)
    i = 0
    while not stop.is_set():
        async with lock:
            for r in routers:
                d = await r.route(text_request(prompt_text(i % 5) + "?"), producers, consumers)
                await r.finished(d, RequestOutcome(None, None, ok=True))
                done.append(1)
        i += 1
        await asyncio.sleep(0.02)


async def test_writer_killed_then_left_residency_stays_exact(
    fake: FakeFactory, procs: ProcessGroup, redis_url: str, tmp_path: Path
) -> None:
    t1, t2, t3 = prompt_text(1), prompt_text(2), prompt_text(3)
    backend = await fake("w0")
    lease_key = ModelKeys.of("pdproxy", SEED).lease(W)
    client = Redis.from_url(redis_url)
    routers: list[KvRouter] = []
    stop, done, lock = asyncio.Event(), [], asyncio.Lock()
    load: asyncio.Task[None] | None = None

    def replica(pub: EventPublisher) -> KvRouter:
        settings = KvRouterSettings.model_validate(options(redis_url, pub))
        r = build_kv_router(settings, metrics_registry=CollectorRegistry())
        routers.append(r)
        return r

    try:
        async with EventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=10_000
        ) as pub:
            config = {
                "backends": [backend_entry(backend, "both")],
                "router": "kv",
                "router_options": options(redis_url, pub),
                "health": {"enabled": False},
            }
            writer = procs.proxy("writer", config, wait=False)
            await wait_healthy(writer)

            async def writer_holds() -> bool:
                return await client.exists(lease_key) == 1

            await until("the writer process takes the lease", writer_holds, pub)
            survivor = replica(pub)
            await survivor.start()
            assert survivor.state.leases is not None
            assert not survivor.state.leases.holds(W)
            load = asyncio.create_task(traffic(routers, lock, stop, done))

            await pub.publish(stored(t1))
            await pub.publish(stored(t2))

            async def both_stored() -> bool:
                return await residency(survivor, [t1, t2]) == [FULL, FULL]

            await until("the writer applies both stores", both_stored, pub)

            writer.kill()  # SIGKILL: the lease is left to expire
            await pub.publish(removed(t1))  # blocks the survivor never applied itself
            await pub.publish(stored(t3))

            async def taken_over() -> bool:
                return survivor.state.leases is not None and survivor.state.leases.holds(W)

            t0 = time.monotonic()
            await until("the survivor takes the stream over", taken_over, pub)
            takeover_s = time.monotonic() - t0

            async def exact_after_kill() -> bool:
                return await residency(survivor, [t1, t2, t3]) == [None, FULL, FULL]

            await until("the gap is replayed and resolved", exact_after_kill, pub)

            late = replica(pub)  # joins after every store it will have to resolve
            await late.start()
            async with lock:
                routers.remove(survivor)
            await survivor.close()  # leaves cleanly: drops its lease at once

            async def late_holds() -> bool:
                return late.state.leases is not None and late.state.leases.holds(W)

            await until("the late replica takes the stream", late_holds, pub)
            await pub.publish(removed(t2))

            async def exact_after_leave() -> bool:
                return await residency(late, [t1, t2, t3]) == [None, None, FULL]

            await until("the late writer resolves an old removal", exact_after_leave, pub)
            stop.set()
            await load
            load = None
    finally:
        stop.set()
        if load is not None:
            await asyncio.gather(load, return_exceptions=True)
        for r in routers:
            await r.close()
        await client.aclose()
    assert done, "no decision was made while replicas came and went"
    print(f"takeover after SIGKILL: {takeover_s:.2f} s (lease ttl {LEASE_TTL_S} s)")

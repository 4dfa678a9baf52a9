"""Worker self-registration through the proxy: vLLM's message joins a backend, heartbeats keep
it, silence or ``leaving`` drains it, and it leaves the registry only once its legs are done;
all while a bounded load runs with no failed request."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from loadtest.fake_backend import Behavior, FakeBackend
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings import ProxySettings
from tests.conftest import free_port
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    backend_entry,
    eventually,
    quick_settings,
)
from tests.pdproxy.fleet.membership.conftest import RegistrationKeys
from tests.pdproxy.fleet.membership.load import Load
from tests.pdproxy.fleet.membership.registrant import Registrant, vllm_message

ADMIN = "admin-key-for-registration-tests"


def registration_settings(
    keys: RegistrationKeys, backends: list[dict[str, Any]], **registration: Any
) -> ProxySettings:
    return quick_settings(
        backends,
        admin_key=ADMIN,
        membership={
            "poll_s": 0.05,
            "drain_grace_s": 0.2,
            "registration": {
                "endpoint": "tcp://127.0.0.1:0",
                "curve_secret_key_file": str(keys.proxy_secret),
                "curve_clients_dir": str(keys.clients_dir),
                "heartbeat_timeout_s": 2.0,
                "dialect": "nixl",
                **registration,
            },
        },
    )


async def members(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url) as admin:
        answer = await admin.get("/admin/members", headers={"authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 200
    listed: list[dict[str, Any]] = answer.json()["members"]
    return listed


async def heartbeat(registrant: Registrant, message: dict[str, Any], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await registrant.send(message)
        await asyncio.sleep(0.2)


async def test_registered_worker_joins_and_leaves_under_load(
    registration_keys: RegistrationKeys, proxy: ProxyFactory, fake: FakeFactory
) -> None:
    stream = {"chunk_delay_s": 0.02, "producer_delay_s": 0.005}
    producer = await fake("P", producer_delay_s=0.005)
    static = await fake("D0", **stream)
    worker = await FakeBackend("W", Behavior(**stream)).start()
    try:
        settings = registration_settings(
            registration_keys,
            [backend_entry(producer, "producer"), backend_entry(static, "consumer")],
        )
        running = await proxy(settings)
        endpoint = running.state.membership.registration.endpoint
        assert endpoint is not None
        registrant = Registrant(
            endpoint,
            secret=registration_keys.worker_secret,
            server_public=registration_keys.proxy_public,
        )
        message = vllm_message("D", worker.port, models=["m"])
        name = f"reg-127.0.0.1-{worker.port}"
        registry = running.state.registry
        stop = asyncio.Event()
        try:
            async with Load(running.url, concurrency=4) as load:
                await load.until(lambda: load.ok >= 10)
                beats = asyncio.create_task(heartbeat(registrant, message, stop))
                await load.until(lambda: len(worker.consumer_legs()) >= 10)
                [listed] = await members(running.url)
                assert (listed["name"], listed["source"], listed["role"], listed["models"]) == (
                    name, "registration", "consumer", ["m"],
                )  # fmt: skip
                assert listed["state"] == "active"
                # The worker stops heartbeating: drained, then removed once its streams end.
                stop.set()
                await beats
                backend = registry.get(name)
                assert backend is not None
                await load.until(lambda: backend.draining)
                await load.until(lambda: registry.get(name) is None)
                assert backend.in_flight == 0 and worker.aborts == 0
                await worker.stop()  # gone for good: a leg sent there now would fail
                served = len(static.consumer_legs())
                await load.until(lambda: len(static.consumer_legs()) >= served + 20)
            assert load.failures == []
            assert load.ok == load.sent
            assert await members(running.url) == []
        finally:
            registrant.close()
    finally:
        await worker.stop()


async def test_leaving_drains_at_once_and_a_new_announcement_replaces(
    registration_keys: RegistrationKeys, proxy: ProxyFactory, fake: FakeFactory
) -> None:
    consumer = await fake("D")
    running = await proxy(registration_settings(registration_keys, [], heartbeat_timeout_s=60.0))
    endpoint = running.state.membership.registration.endpoint
    assert endpoint is not None
    registrant = Registrant(
        endpoint,
        secret=registration_keys.worker_secret,
        server_public=registration_keys.proxy_public,
    )
    registry = running.state.registry
    name = f"reg-127.0.0.1-{consumer.port}"
    try:
        await registrant.send(vllm_message("D", consumer.port, models=["a"]))
        await eventually(lambda: registry.get(name) is not None, 5)
        first = registry.get(name)
        await registrant.send(vllm_message("D", consumer.port, models=["a", "b"]))
        await eventually(lambda: registry.get(name) is not first, 5)
        second = registry.get(name)
        assert second is not None and second.config.models == ("a", "b")
        assert first is not None and first.removed
        async with httpx.AsyncClient(base_url=running.url) as client:
            answer = await client.post("/v1/completions", json={"model": "a", "prompt": "hi"})
        assert answer.status_code == 200
        await registrant.send(vllm_message("D", consumer.port, models=["a", "b"], leaving=True))
        await eventually(lambda: registry.get(name) is None, 5)  # long before the 60 s timeout
    finally:
        registrant.close()


async def test_kv_router_follows_a_registered_workers_events(
    registration_keys: RegistrationKeys, proxy: ProxyFactory, fake: FakeFactory
) -> None:
    """The announced ``events_endpoint`` is subscribed while the worker is a member, and
    dropped (its residency forgotten) once it has been removed."""
    consumer = await fake("D")
    settings = registration_settings(registration_keys, [], heartbeat_timeout_s=60.0)
    settings = settings.model_copy(
        update={
            "router": "kv",
            "router_options": {"model_seed": "m/seed=0", "tokenizer": {"kind": "bytes"}},
        }
    )
    running = await proxy(settings)
    router = running.state.router
    assert isinstance(router, KvRouter)
    endpoint = running.state.membership.registration.endpoint
    assert endpoint is not None
    registrant = Registrant(
        endpoint,
        secret=registration_keys.worker_secret,
        server_public=registration_keys.proxy_public,
    )
    name = f"reg-127.0.0.1-{consumer.port}"
    events = f"tcp://127.0.0.1:{free_port()}"
    try:
        await registrant.send(vllm_message("D", consumer.port, events_endpoint=events))
        await eventually(lambda: router.feeds.subscriber(name) is not None, 10)
        await registrant.send(
            vllm_message("D", consumer.port, events_endpoint=events, leaving=True)
        )
        await eventually(lambda: running.state.registry.get(name) is None, 5)
        await eventually(lambda: router.feeds.subscriber(name) is None, 10)
    finally:
        registrant.close()


async def test_members_listing_needs_the_admin_key(
    registration_keys: RegistrationKeys, proxy: ProxyFactory
) -> None:
    running = await proxy(registration_settings(registration_keys, []))
    async with httpx.AsyncClient(base_url=running.url) as client:
        assert (await client.get("/admin/members")).status_code == 401
        wrong = {"authorization": "Bearer not-the-admin-key"}
        assert (await client.get("/admin/members", headers=wrong)).status_code == 401
    assert await members(running.url) == []
    plain = await proxy(quick_settings([]))  # no admin_key: the admin API is off
    async with httpx.AsyncClient(base_url=plain.url) as client:
        assert (await client.get("/admin/members")).status_code == 404

"""The admin routes over membership (issue 30 finding 7): removed registrants are listed, a
removal is taken back with ``POST /admin/members/{name}/readmit``, and
``POST /admin/registration/reload-keys`` revokes a deleted key at once; all behind the admin
key like every other admin route."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.pdproxy.conftest import FakeFactory, ProxyFactory, eventually, quick_settings
from tests.pdproxy.fleet.membership.conftest import RegistrationKeys
from tests.pdproxy.fleet.membership.registrant import Registrant, vllm_message
from tests.pdproxy.fleet.membership.test_registration import ADMIN, registration_settings

AUTH = {"authorization": f"Bearer {ADMIN}"}


async def listing(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as admin:
        answer = await admin.get("/admin/members", headers=AUTH)
    assert answer.status_code == 200
    body: dict[str, Any] = answer.json()
    return body


async def test_a_removed_registrant_is_listed_and_readmitted(
    registration_keys: RegistrationKeys, proxy: ProxyFactory, fake: FakeFactory
) -> None:
    consumer = await fake("D")
    running = await proxy(registration_settings(registration_keys, [], heartbeat_timeout_s=60.0))
    endpoint = running.state.membership.registration.endpoint
    assert endpoint is not None
    registrant = Registrant(
        endpoint, secret=registration_keys.worker_secret,
        server_public=registration_keys.proxy_public,
    )  # fmt: skip
    registry = running.state.registry
    name = f"reg-127.0.0.1-{consumer.port}"
    message = vllm_message("D", consumer.port, models=["a"])
    try:
        await registrant.send(message)
        await eventually(lambda: registry.get(name) is not None, 5)
        async with httpx.AsyncClient(base_url=running.url, headers=AUTH) as admin:
            assert (await admin.delete(f"/admin/backends/{name}")).status_code == 200
            await registrant.send(message)  # the next announcement does not bring it back
            await eventually(lambda: name in running.state.membership.membership.removed(), 5)
            for _ in range(5):
                await registrant.send(message)
                await asyncio.sleep(0.05)
            assert registry.get(name) is None
            seen = await listing(running.url)
            assert seen["members"] == []
            assert [r["name"] for r in seen["removed"]] == [name]
            assert seen["removed"][0]["source"] == "registration"
            answer = await admin.post(f"/admin/members/{name}/readmit")
            assert answer.status_code == 200 and answer.json()["readmitted"] is True
            assert (await admin.post(f"/admin/members/{name}/readmit")).status_code == 404
            await registrant.send(message)
            await eventually(lambda: registry.get(name) is not None, 5)
            assert (await listing(running.url))["removed"] == []
    finally:
        registrant.close()


async def test_reload_keys_revokes_a_deleted_key_at_once(
    registration_keys: RegistrationKeys, proxy: ProxyFactory, fake: FakeFactory
) -> None:
    consumer = await fake("D")
    settings = registration_settings(
        registration_keys, [], heartbeat_timeout_s=60.0, keys_reload_s=3600.0
    )
    running = await proxy(settings)
    endpoint = running.state.membership.registration.endpoint
    assert endpoint is not None
    registrant = Registrant(
        endpoint, secret=registration_keys.worker_secret,
        server_public=registration_keys.proxy_public,
    )  # fmt: skip
    membership = running.state.membership.membership
    name = f"reg-127.0.0.1-{consumer.port}"
    try:
        await registrant.send(vllm_message("D", consumer.port, models=["a"]))
        await eventually(lambda: membership.get(name) is not None, 5)
        async with httpx.AsyncClient(base_url=running.url, headers=AUTH) as admin:
            unchanged = await admin.post("/admin/registration/reload-keys")
            assert unchanged.status_code == 200 and unchanged.json()["changed"] is False
            (registration_keys.clients_dir / "worker.key").unlink()
            answer = await admin.post("/admin/registration/reload-keys")
        assert answer.status_code == 200
        assert answer.json() == {"changed": True, "added": 0, "revoked": 1}
        member = membership.get(name)
        assert member is None or member.draining  # at once, not after keys_reload_s
    finally:
        registrant.close()


async def test_membership_admin_routes_need_the_admin_key(
    registration_keys: RegistrationKeys, proxy: ProxyFactory
) -> None:
    running = await proxy(registration_settings(registration_keys, []))
    wrong = {"authorization": "Bearer not-the-admin-key"}
    paths = ["/admin/members/x/readmit", "/admin/registration/reload-keys"]
    async with httpx.AsyncClient(base_url=running.url) as client:
        for path in paths:
            assert (await client.post(path)).status_code == 401
            assert (await client.post(path, headers=wrong)).status_code == 401
    plain = await proxy(quick_settings([]))  # no admin_key: the admin API is off
    async with httpx.AsyncClient(base_url=plain.url) as client:
        for path in paths:
            assert (await client.post(path, headers=AUTH)).status_code == 404

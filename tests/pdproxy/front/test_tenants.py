"""Tenant isolation (issue 30, finding 4): each tenant's ``cache_salt`` on both legs and in the
router's hashes, no client salt that yields another tenant's, ``cached_tokens`` hidden from keys
not allowed to see it. Attacker-side, with the reference workers: tests/reliability's
``test_proxy_tenant_isolation``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from starlette.datastructures import Headers
from starlette.types import Message

from pdproxy.front.intake import ANONYMOUS, Caller, ClientKeys, TenantId, decode_body
from pdproxy.front.tenants import CachedTokensHidden, CacheSalts, hide_cached_tokens
from pdproxy.routing.base import BackendView, RequestOutcome, RouteDecision, RouteRequest
from pdproxy.routing.simple import RoundRobinRouter
from pdproxy.settings import ApiKey
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

_KEYS = [
    {"key": "alice-key-0123456789", "tenant": "A", "see_cached_tokens": True},
    {"key": "bob-key-0123456789"},
    {"key": "carol-key-0123456789", "tenant": "C", "see_cached_tokens": True},
]


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class SaltRecordingRouter:
    """Round robin; keeps the ``cache_salt`` of every body it was asked to route."""

    def __init__(self) -> None:
        self._inner = RoundRobinRouter()
        self.salts: list[object] = []

    async def start(self) -> None:
        return None

    async def route(
        self, request: RouteRequest, producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision:  # fmt: skip
        self.salts.append(request.body.get("cache_salt"))
        return await self._inner.route(request, producers, consumers)

    async def finished(self, decision: RouteDecision, outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None


async def _pd_proxy(fake: FakeFactory, proxy: ProxyFactory, **overrides: Any) -> Any:
    p0, c0 = await fake("p0"), await fake("c0", cached_tokens=496)
    router = SaltRecordingRouter()
    running = await proxy(
        quick_settings(
            [backend_entry(p0, "producer"), backend_entry(c0, "consumer")],
            api_keys=_KEYS,
            **overrides,
        ),
        router=router,
    )
    return running, router, p0, c0


async def test_both_legs_and_the_router_carry_the_tenants_derived_salt(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    running, router, p0, c0 = await _pd_proxy(fake, proxy)
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    async with running.client() as client:
        for key in (_KEYS[0]["key"], _KEYS[0]["key"], _KEYS[1]["key"]):
            resp = await client.post("/v1/completions", json=body, headers=_auth(key))
            assert resp.status_code == 200, resp.text
    produced = [leg.json().get("cache_salt") for leg in p0.producer_legs()]
    consumed = [leg.json().get("cache_salt") for leg in c0.consumer_legs()]
    assert produced == consumed == router.salts, (produced, consumed, router.salts)
    alice, alice_again, bob = produced
    assert isinstance(alice, str) and len(alice) == 64  # an HMAC-SHA256, hex
    assert alice == alice_again != bob
    assert "alice" not in alice and alice != "A"  # neither the key nor the tenant's name


async def test_a_client_salt_cannot_join_another_tenants_cache(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    running, _, _, c0 = await _pd_proxy(fake, proxy)
    body: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 2}
    bob = _auth(_KEYS[1]["key"])
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=body, headers=_auth(_KEYS[0]["key"]))
        assert resp.status_code == 200
        alice = c0.consumer_legs()[0].json()["cache_salt"]
        # Bob replays alice's salt, her tenant's name, and guesses of the derivation's input.
        for guess in (alice, "A", "name:A", "1:A", "6:name:A", "alice-key-0123456789"):
            resp = await client.post(
                "/v1/completions", json={**body, "cache_salt": guess}, headers=bob
            )
            assert resp.status_code == 200, resp.text
        # A salt of the client's own splits its tenant's cache further, consistently.
        for _ in range(2):
            resp = await client.post(
                "/v1/completions", json={**body, "cache_salt": "mine"},
                headers=_auth(_KEYS[0]["key"]),
            )  # fmt: skip
        resp = await client.post("/v1/completions", json={**body, "cache_salt": 7}, headers=bob)
        assert resp.status_code == 400
    salts = [leg.json()["cache_salt"] for leg in c0.consumer_legs()]
    bobs, own = salts[1:7], salts[7:]
    assert alice not in bobs and len(set(bobs)) == 6
    assert own[0] == own[1] != alice


def test_salts_are_keyed_by_the_proxy_secret() -> None:
    tenant = TenantId("name:A")
    one, other = CacheSalts(b"s" * 32), CacheSalts(b"t" * 32)
    assert one.salt(tenant, None) == one.salt(tenant, None) != other.salt(tenant, None)
    # Length-prefixed: tenant "A" + client salt "B" is not tenant "AB".
    assert one.salt(TenantId("A"), "B") != one.salt(TenantId("AB"), None)
    assert one.salt(tenant, "x") != one.salt(tenant, None)


def test_no_keys_is_one_tenant_and_shared_prefixes_add_no_salt() -> None:
    salts = CacheSalts(b"s" * 32)
    body = decode_body(b'{"prompt":"hi","cache_salt":"theirs"}')
    assert ClientKeys([]).authenticate(_headers({})) is ANONYMOUS
    assert salts.salted(ANONYMOUS, body) is body  # bodies untouched, the client's salt kept
    key = ApiKey.model_validate({"key": "k" * 20})
    shared = ClientKeys([key], share_prefixes=True).authenticate(_headers(_auth("k" * 20)))
    assert shared.tenant is None and not shared.sees_cached_tokens
    own = ClientKeys([key]).authenticate(_headers(_auth("k" * 20)))
    assert own.tenant is not None and own.tenant.startswith("key:") and "k" * 20 not in own.tenant
    assert salts.salted(own, body).data["cache_salt"] != "theirs"


def _headers(values: dict[str, str]) -> Headers:
    return Headers(values)


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_hidden_from_keys_not_allowed_to_see_them(
    fake: FakeFactory, proxy: ProxyFactory, stream: bool
) -> None:
    running, _, _, _ = await _pd_proxy(fake, proxy)
    body: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    seen = {}
    async with running.client() as client:
        for who, key in (("alice", _KEYS[0]["key"]), ("bob", _KEYS[1]["key"])):
            resp = await client.post("/v1/completions", json=body, headers=_auth(key))
            assert resp.status_code == 200, resp.text
            if stream:
                events = [e for e in resp.text.split("\n\n") if e.startswith("data: {")]
                usage = orjson.loads(events[-1][6:])["usage"]
                assert resp.text.endswith("data: [DONE]\n\n")
            else:
                usage = resp.json()["usage"]
            seen[who] = usage["prompt_tokens_details"]["cached_tokens"]
    assert seen == {"alice": 496, "bob": 0}


def test_hiding_changes_only_the_figure() -> None:
    answer = b'{"usage":{"prompt_tokens":8,"prompt_tokens_details":{"cached_tokens": 496}}}'
    assert hide_cached_tokens(answer) == answer.replace(b"496", b"0")
    untouched = b'data: {"choices":[{"text":"cached_tokens: 496"}]}\n\n'
    assert hide_cached_tokens(untouched) is untouched


async def test_a_figure_split_across_reads_is_still_hidden() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    hidden = CachedTokensHidden(send)
    chunk = b'data: {"choices":[{"text":"x"}]}\n\n'
    usage = b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":496}}}\n\n'
    await hidden({"type": "http.response.start", "status": 200, "headers": []})
    await hidden({"type": "http.response.body", "body": chunk, "more_body": True})
    cut = usage.index(b"49") + 1
    await hidden({"type": "http.response.body", "body": usage[:cut], "more_body": True})
    await hidden({"type": "http.response.body", "body": usage[cut:], "more_body": True})
    await hidden({"type": "http.response.body", "body": b"data: [DONE]", "more_body": True})
    await hidden({"type": "http.response.body", "body": b"", "more_body": False})
    bodies = [m["body"] for m in sent[1:]]
    assert bodies == [chunk, usage.replace(b"496", b"0"), b"data: [DONE]"]
    assert sent[-1]["more_body"] is False


def test_caller_of_a_key() -> None:
    keys = ClientKeys([ApiKey.model_validate(k) for k in _KEYS])
    alice = keys.authenticate(_headers(_auth(_KEYS[0]["key"])))
    scope = hashlib.sha256(str(_KEYS[0]["key"]).encode()).digest()[:8].hex()
    assert alice == Caller(
        trusted=False, tenant=TenantId("name:A"), sees_cached_tokens=True, key_scope=scope
    )
    # Sessions are scoped by the key: never by its tenant, never the key itself.
    others = {keys.authenticate(_headers(_auth(k["key"]))).key_scope for k in _KEYS[1:]}
    assert scope not in others and str(_KEYS[0]["key"]) not in scope

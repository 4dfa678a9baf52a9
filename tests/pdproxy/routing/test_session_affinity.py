"""Session affinity: multi-turn sessions stick to the node of their last turn, expire after the
TTL, stay within the table's cap, yield to the hot-spot guard, and are scoped per client key."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from starlette.datastructures import Headers

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.base import RequestOutcome, RouteRequest
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.scorers.affinity import AffinityScorer, SessionAffinity, boost
from pdproxy.routing.kv.state import LoadDelta
from pdproxy.routing.session import MAX_SESSION_ID_CHARS, session_of
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import AffinitySettings

from .kv_helpers import BS, SEED, pool, prompt_text
from .test_kv_router import make_router

# No producers: every node prefills alone; predictions gone before the next turn (a user
# thinks for longer than prediction_ttl_s) and no KV events: what affinity is for.
SETTINGS = KvRouterSettings(model_seed=SEED, block_size=BS, prediction_ttl_s=1e-6)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, **settings: object) -> SessionAffinity:
    return SessionAffinity(
        AffinitySettings.model_validate(settings), CollectorRegistry(), clock=clock
    )


def test_an_entry_lives_for_its_ttl_refreshed_by_each_turn() -> None:
    clock = Clock()
    aff = table(clock, ttl_s=10.0)
    aff.remember("k:s1", "c1", 8)
    assert aff.sticky_node("k:s1") == ("c1", 8)
    clock.now += 9
    aff.remember("k:s1", "c1", 12)
    clock.now += 9
    assert aff.sticky_node("k:s1") == ("c1", 12)
    clock.now += 10
    assert aff.sticky_node("k:s1") is None
    assert len(aff) == 0


@given(st.lists(st.integers(0, 50), max_size=300), st.integers(1, 20))
def test_the_table_never_exceeds_its_cap_and_keeps_the_most_recent(
    sessions: list[int], cap: int
) -> None:
    aff = table(Clock(), max_sessions=cap)
    for s in sessions:
        aff.remember(f"k:{s}", f"n{s}", 1)
        assert len(aff) <= cap
    recent = list(dict.fromkeys(reversed(sessions)))[:cap]
    assert all(aff.sticky_node(f"k:{s}") == (f"n{s}", 1) for s in recent)


def test_boost_credits_the_sticky_node_up_to_the_prompt() -> None:
    matches = {NodeId("c0"): Match(gpu=3, total=3, predicted=3)}
    assert boost(("c1", 10), matches, 6)[NodeId("c1")] == Match(predicted=6)
    # a node that holds more than the session's entry says is left as it is
    assert boost(("c0", 2), matches, 6)[NodeId("c0")] == matches[NodeId("c0")]


def test_session_comes_from_the_header_or_the_user_field_scoped_by_key() -> None:
    body = {"user": "alice"}
    by_user = session_of(Headers({}), body)
    by_header = session_of(Headers({"x-session-id": "s-1"}), body)
    assert by_user is not None and by_user.endswith(":alice")
    assert by_header is not None and by_header.endswith(":s-1")
    key_a = session_of(Headers({"authorization": "Bearer A", "x-session-id": "s"}), {})
    key_b = session_of(Headers({"authorization": "Bearer B", "x-session-id": "s"}), {})
    assert key_a != key_b  # one key's client cannot steer another key's session
    assert session_of(Headers({"x-session-id": "x" * (MAX_SESSION_ID_CHARS + 1)}), {}) is None
    assert session_of(Headers({}), {"user": 42}) is None
    assert session_of(Headers({}), {"user": ""}) is None


def test_an_authenticated_keys_scope_is_used_as_given() -> None:
    """With keys configured the path passes the key's scope (parsed once, at intake): the
    header is not read again, and two keys' scopes keep their sessions apart."""
    spoofed = Headers({"authorization": "Bearer somebody-else", "x-session-id": "s"})
    assert session_of(spoofed, {}, "scope-a") == "scope-a:s"
    assert session_of(spoofed, {}, "scope-b") != session_of(spoofed, {}, "scope-a")


def turn(text: str, session: str | None) -> RouteRequest:
    return RouteRequest(
        uuid.uuid4().hex, "completions", {"model": "m", "prompt": text}, session=session
    )


@pytest.fixture
async def router() -> AsyncIterator[KvRouter]:
    r = make_router(SETTINGS)
    await r.start()
    try:
        yield r
    finally:
        await r.close()


async def _serve(router: KvRouter, request: RouteRequest, consumers: list) -> str:  # type: ignore[type-arg]
    d = await router.route(request, [], consumers)
    chosen = d.consumers[0].name
    await router.finished(d, RequestOutcome(None, chosen, ok=True))
    return chosen


def _sample(router: KvRouter, outcome: str) -> float:
    value = router.metrics.registry.get_sample_value(
        "pdproxy_kv_router_session_affinity_total", {"outcome": outcome}
    )
    return value or 0.0


async def test_multi_turn_sessions_stick_to_the_node_of_their_last_turn(router: KvRouter) -> None:
    _, consumers = pool(0, 4)
    history = {s: prompt_text(s, 256) for s in range(6)}
    # First turns arrive together: load spreads them over the nodes.
    firsts = {
        s: await router.route(turn(text, f"k:{s}"), [], consumers) for s, text in history.items()
    }
    homes = {s: d.consumers[0].name for s, d in firsts.items()}
    assert len(set(homes.values())) == 4
    for s, d in firsts.items():
        await router.finished(d, RequestOutcome(None, homes[s], ok=True))
    for round_ in range(3):
        for s, text in list(history.items()):
            history[s] = text + f" turn {round_} of session {s}, a reply and a new question."
            assert await _serve(router, turn(history[s], f"k:{s}"), consumers) == homes[s]
    assert _sample(router, "sticky") == 18
    # Without sessions, the same turns spread by load and name alone (nothing cached is known).
    spread = {await _serve(router, turn(history[s] + " again", None), consumers) for s in history}
    assert spread == {"c0"}  # idle nodes tie: the cheapest name wins every time


async def test_a_hot_sticky_node_yields_to_the_guard(router: KvRouter) -> None:
    _, consumers = pool(0, 3)
    text = prompt_text(7, 512)
    home = await _serve(router, turn(text, "k:hot"), consumers)
    imbalance = router.settings.hotspot_max_imbalance
    router.state.local.apply([LoadDelta(home, imbalance + 1, 0)])
    d = await router.route(turn(text + " next", "k:hot"), [], consumers)
    assert d.consumers[0].name != home
    assert d.consumers[-1].name == home  # guarded: ranked after every other node
    assert _sample(router, "moved") == 1
    await router.finished(d, RequestOutcome(None, d.consumers[0].name, ok=True))
    router.state.local.apply([LoadDelta(home, -(imbalance + 1), 0)])
    # the session follows where its last turn was served
    again = await router.route(turn(text + " next more", "k:hot"), [], consumers)
    assert again.consumers[0].name == d.consumers[0].name
    await router.finished(again, RequestOutcome(None, again.consumers[0].name, ok=True))


async def test_a_failed_turn_does_not_move_the_session(router: KvRouter) -> None:
    _, consumers = pool(0, 2)
    text = prompt_text(9, 256)
    home = await _serve(router, turn(text, "k:f"), consumers)
    d = await router.route(turn(text + " b", "k:f"), [], consumers)
    other = next(c.name for c in consumers if c.name != home)
    await router.finished(d, RequestOutcome(None, other, ok=False))
    d2 = await router.route(turn(text + " c", "k:f"), [], consumers)
    assert d2.consumers[0].name == home
    await router.finished(d2, RequestOutcome(None, home, ok=True))


async def test_affinity_off_ignores_sessions() -> None:
    off = SETTINGS.model_copy(update={"affinity": AffinitySettings(enabled=False)})
    r = make_router(off)
    _, consumers = pool(0, 3)
    try:
        text = prompt_text(3, 256)
        first = await _serve(r, turn(text, "k:x"), consumers)
        assert first == "c0"
        r.state.local.apply([LoadDelta("c0", 1, 0)])
        assert await _serve(r, turn(text + " y", "k:x"), consumers) != "c0"
        assert len(r.scorer(AffinityScorer).sessions) == 0
    finally:
        await r.close()


async def test_one_keys_client_cannot_move_another_keys_session(router: KvRouter) -> None:
    """Attacker: a client with key B sends the session id of key A's conversation, from a hot
    node's point of view: its turns land in B's own entry and A's session keeps its node."""
    _, consumers = pool(0, 3)
    a = session_of(Headers({"authorization": "Bearer A", "x-session-id": "conv-1"}), {})
    b = session_of(Headers({"authorization": "Bearer B", "x-session-id": "conv-1"}), {})
    text = prompt_text(11, 256)
    home = await _serve(router, turn(text, a), consumers)
    router.state.local.apply([LoadDelta(home, 1, 0)])  # B's turn goes elsewhere by load
    elsewhere = await _serve(router, turn(text + " b", b), consumers)
    assert elsewhere != home
    router.state.local.apply([LoadDelta(home, -1, 0)])
    assert await _serve(router, turn(text + " a", a), consumers) == home


async def test_the_proxy_hands_the_session_to_the_router(proxy, fake) -> None:  # type: ignore[no-untyped-def]
    from tests.pdproxy.conftest import backend_entry, quick_settings

    seen: list[str | None] = []

    class Capture:
        async def start(self) -> None:
            return None

        async def route(self, request, producers, consumers):  # type: ignore[no-untyped-def]
            from pdproxy.routing.base import RouteDecision

            seen.append(request.session)
            return RouteDecision(request.request_id, list(consumers), [])

        async def finished(self, decision, outcome) -> None:  # type: ignore[no-untyped-def]
            return None

        async def close(self) -> None:
            return None

    d = await fake("d")
    running = await proxy(quick_settings([backend_entry(d, "consumer")]), router=Capture())
    async with running.client() as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1, "user": "u-1"}
        await client.post("/v1/completions", json=body, headers={"x-session-id": "s-9"})
        await client.post("/v1/completions", json=body)
        await client.post("/v1/completions", json={**body, "user": None})
    assert seen[0] is not None and seen[0].endswith(":s-9")
    assert seen[1] is not None and seen[1].endswith(":u-1")
    assert seen[2] is None

"""Mid-stream failover, end to end through a real proxy and small real consumers.

Scenarios over where a consumer can fail (between events, in the middle of one, with an error
event, ending without ``[DONE]``, stalling, after its last token) by both routes: the client
gets one uninterrupted stream whose text equals the uninterrupted answer of the greedy model
(:mod:`tests.pdproxy.greedy_consumer`), one identity, one adjusted usage chunk, one ``[DONE]``.
Bounds (two failures, everyone dead), refusals, the client leaving, and nothing left held.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.routing.base import BackendView, RequestOutcome, RouteDecision, RouteRequest
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RunningProxy,
    backend_entry,
    eventually,
    quick_settings,
)
from tests.pdproxy.greedy_consumer import Fault, GreedyConsumer, greedy, render_chat

PROMPT = "Tell me a story about a fox. "
TOKENS = 12


class InOrder:
    """Ranks consumers in the order they were configured (the test decides who fails)."""

    async def start(self) -> None:
        return None

    async def route(
        self, request: RouteRequest, producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision[Any]:  # fmt: skip
        return RouteDecision(
            request.request_id, list(consumers), list(producers), reason="in-order"
        )

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest.fixture
async def consumers() -> AsyncIterator[list[GreedyConsumer]]:
    made = [await GreedyConsumer(name).start() for name in ("a", "b", "c")]
    yield made
    for c in made:
        await c.stop()


async def _proxy(
    proxy: ProxyFactory, cons: list[GreedyConsumer], migrations: int = 1, idle_s: float = 30.0
) -> RunningProxy:
    backends = [{"name": c.name, "url": c.url, "role": "consumer"} for c in cons]
    settings = quick_settings(
        backends,
        failover={"max_migrations": migrations},
        timeouts={"consumer_idle_s": idle_s},
    )
    return await proxy(settings, router=InOrder())


def _body(route: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": TOKENS, "stream": True, "temperature": 0}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return {**body, **extra}


def _expected(route: str, body: dict[str, Any]) -> str:
    prompt = render_chat(body) if route == "chat" else body["prompt"]
    return greedy(prompt, TOKENS)


async def _stream(
    running: RunningProxy, route: str, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], int]:
    """The data events of one streamed answer (``{"done": True}`` for ``[DONE]``), and the
    count of ``[DONE]``s."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    events: list[dict[str, Any]] = []
    done = 0
    async with running.client() as client, client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        raw = b""
        async for chunk in resp.aiter_bytes():
            raw += chunk
    assert raw.endswith(b"\n\n"), raw[-200:]
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block
        data = block[6:]
        if data == b"[DONE]":
            done += 1
        else:
            events.append(orjson.loads(data))
    return events, done


def _text(events: list[dict[str, Any]]) -> str:
    out = ""
    for e in events:
        for c in e.get("choices") or []:
            out += c["delta"].get("content", "") if "delta" in c else c.get("text", "")
    return out


def _migrations(running: RunningProxy, outcome: str) -> float:
    value = running.state.metrics.registry.get_sample_value(
        "pdproxy_stream_migrations_total", {"outcome": outcome}
    )
    return value or 0.0


async def _nothing_held(running: RunningProxy, cons: list[GreedyConsumer]) -> None:
    await eventually(lambda: all(b.in_flight == 0 for b in running.state.registry.all()))
    await eventually(lambda: all(c.open_connections <= 1 for c in cons))


FAULTS = ["reset", "mid_event", "error_event", "truncate", "stall", "garbage"]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("kind", FAULTS)
async def test_stream_migrates_and_equals_the_uninterrupted_answer(
    proxy: ProxyFactory, consumers: list[GreedyConsumer], route: str, kind: str
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault(kind, after=4)
    running = await _proxy(proxy, [a, b], idle_s=0.5)
    body = _body(route, stream_options={"include_usage": True})
    events, done = await _stream(running, route, body)

    assert "error" not in str(events)
    assert done == 1
    assert _text(events) == _expected(route, body)
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1
    assert events[0]["id"].endswith("-a-1")  # the first consumer's identity throughout
    usages = [e["usage"] for e in events if e.get("usage")]
    prompt_tokens = len((render_chat(body) if route == "chat" else PROMPT).encode())
    assert usages == [
        {"prompt_tokens": prompt_tokens, "completion_tokens": TOKENS,
         "total_tokens": prompt_tokens + TOKENS}
    ]  # fmt: skip
    if route == "chat":
        assert sum(1 for e in events for c in e["choices"] if "role" in c["delta"]) == 1
    # The continuation leg: the prompt's ids + the 4 tokens' ids relayed (as the first consumer
    # sent them), what remains of max_tokens; the client never saw an id it did not ask for.
    cont = b.bodies[-1]
    assert cont["max_tokens"] == TOKENS - 4
    prompt_text = render_chat(body) if route == "chat" else PROMPT
    ids = list((prompt_text + _expected(route, body)[:4]).encode())
    if route == "chat":
        assert cont["kv_transfer_params"] == {"prompt_token_ids": ids}
        # The text form rides along for an engine that does not reuse ids.
        assert cont["messages"][-1] == {"role": "assistant", "content": _expected(route, body)[:4]}
        assert cont["continue_final_message"] is True
        assert cont["add_generation_prompt"] is False
    else:
        assert cont["prompt"] == ids
    assert "token_ids" not in str(events)
    assert _migrations(running, "migrated") == 1
    await _nothing_held(running, consumers)


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_without_token_ids_the_stream_continues_from_text(
    proxy: ProxyFactory, consumers: list[GreedyConsumer], route: str
) -> None:
    """``failover.token_ids: false`` (an engine that refuses ``return_token_ids``), or a chat
    engine that ignores ``kv_transfer_params.prompt_token_ids``: the text form, still exact
    with this byte-level model."""
    a, b = consumers[0], consumers[1]
    a.fault = Fault("reset", after=4)
    backends = [{"name": c.name, "url": c.url, "role": "consumer"} for c in (a, b)]
    settings = quick_settings(backends, failover={"max_migrations": 1, "token_ids": False})
    running = await proxy(settings, router=InOrder())
    body = _body(route)
    events, done = await _stream(running, route, body)
    assert (_text(events), done) == (_expected(route, body), 1)
    cont = b.bodies[-1]
    assert "return_token_ids" not in a.bodies[-1]
    if route == "chat":
        assert "kv_transfer_params" not in cont
        assert cont["messages"][-1] == {"role": "assistant", "content": _expected(route, body)[:4]}
    else:
        assert cont["prompt"] == PROMPT + _expected(route, body)[:4]
    b.reuses_prompt_ids = False
    a.fault = Fault("reset", after=5)
    on = await _proxy(proxy, [a, b])
    events, done = await _stream(on, route, body)
    assert (_text(events), done) == (_expected(route, body), 1)


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_ids_the_client_asked_for_are_its_own_prompt_and_every_token(
    proxy: ProxyFactory, consumers: list[GreedyConsumer], route: str
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("mid_event", after=3)
    running = await _proxy(proxy, [a, b])
    body = _body(route, return_token_ids=True)
    events, done = await _stream(running, route, body)
    expected = _expected(route, body)
    assert (_text(events), done) == (expected, 1)
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == list(expected.encode())
    prompt_text = render_chat(body) if route == "chat" else PROMPT
    sent = [
        p for e in events for p in (e.get("prompt_token_ids"),
                                    *(c.get("prompt_token_ids") for c in e["choices"])) if p
    ]  # fmt: skip
    assert sent == [list(prompt_text.encode())]  # once, the client's prompt: not the continuation's


@pytest.mark.parametrize("kind", ["before_usage", "mid_usage"])
async def test_a_consumer_dying_after_its_last_token_needs_no_new_leg(
    proxy: ProxyFactory, consumers: list[GreedyConsumer], kind: str
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault(kind)
    running = await _proxy(proxy, [a, b])
    body = _body("completions", stream_options={"include_usage": True})
    events, done = await _stream(running, "completions", body)
    assert done == 1
    assert _text(events) == _expected("completions", body)
    assert events[-1]["usage"]["completion_tokens"] == TOKENS
    assert events[-1]["choices"] == []
    assert b.bodies == []
    assert _migrations(running, "closed") == 1
    await _nothing_held(running, consumers)


async def test_usage_the_client_did_not_ask_for_is_not_sent(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("reset", after=2)
    running = await _proxy(proxy, [a, b])
    body = _body("chat")
    events, done = await _stream(running, "chat", body)
    assert done == 1
    assert _text(events) == _expected("chat", body)
    assert all(e.get("usage") is None for e in events)
    assert all(e["choices"] for e in events)


async def test_two_failures_migrate_twice_when_allowed(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    a, b, c = consumers
    a.fault = Fault("reset", after=3)
    b.fault = Fault("mid_event", after=2)
    running = await _proxy(proxy, consumers, migrations=2)
    body = _body("completions", stream_options={"include_usage": True})
    events, done = await _stream(running, "completions", body)
    assert done == 1
    assert _text(events) == _expected("completions", body)
    assert events[-1]["usage"]["completion_tokens"] == TOKENS
    assert c.bodies[-1]["max_tokens"] == TOKENS - 5
    assert _migrations(running, "migrated") == 2
    await _nothing_held(running, consumers)


async def test_migrations_are_bounded(proxy: ProxyFactory, consumers: list[GreedyConsumer]) -> None:
    a, b, c = consumers
    a.fault = Fault("reset", after=3)
    b.fault = Fault("reset", after=2)
    running = await _proxy(proxy, consumers, migrations=1)
    events, done = await _stream(running, "completions", _body("completions"))
    assert done == 0
    assert events[-1]["error"]["code"] == "consumer_stream_broken"
    assert _text(events[:-1]) == _expected("completions", _body("completions"))[:5]
    assert c.bodies == []  # the bound held: no third leg
    assert _migrations(running, "exhausted") == 1
    await _nothing_held(running, consumers)


async def test_every_consumer_dead_ends_with_one_error_event(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("reset", after=3)
    running = await _proxy(proxy, [a, b], migrations=2)
    await b.stop()
    events, done = await _stream(running, "completions", _body("completions"))
    assert done == 0
    assert [e for e in events if "error" in e] == [events[-1]]
    assert _migrations(running, "exhausted") == 1
    await _nothing_held(running, consumers)


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"logprobs": 2}, {"tools": [{"type": "function", "function": {"name": "f"}}]}],
)
async def test_requests_that_cannot_continue_exactly_end_as_today(
    proxy: ProxyFactory, consumers: list[GreedyConsumer], extra: dict[str, Any]
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("reset", after=3)
    running = await _proxy(proxy, [a, b])
    body = _body("completions", **extra)
    events, done = await _stream(running, "completions", body)
    assert done == 0
    assert "error" in events[-1]
    assert b.bodies == []
    assert "stream_options" not in a.bodies[-1]  # relayed as without failover


async def test_failover_off_relays_the_clients_bytes(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("reset", after=3)
    running = await _proxy(proxy, [a, b], migrations=0)
    body = _body("completions")
    events, _ = await _stream(running, "completions", body)
    assert "error" in events[-1]
    assert a.bodies[-1] == body
    assert b.bodies == []


async def test_a_client_that_left_is_not_migrated(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("stall", after=3)
    running = await _proxy(proxy, [a, b], idle_s=2.0)
    body = _body("completions")
    async with running.client() as client, client.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            break  # leave after the first bytes, while the consumer stalls
    await asyncio.sleep(2.5)  # past the idle deadline: a migration would have started now
    assert b.bodies == []
    assert _migrations(running, "migrated") == 0
    await _nothing_held(running, consumers)


async def test_hostile_consumer_event_cannot_make_the_proxy_send_twice(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    """Threat: a consumer (or whoever answers on its address) sends [DONE] before the answer
    finished, hoping the proxy relays a short answer as whole: it counts as a failure and the
    next consumer continues from what the client has, never repeating a byte."""
    a, b = consumers[0], consumers[1]
    a.fault = Fault("error_event", after=1)
    running = await _proxy(proxy, [a, b])
    body = _body("completions")
    events, done = await _stream(running, "completions", body)
    assert done == 1
    assert _text(events) == _expected("completions", body)


async def test_raw_stream_bytes_reach_the_client_once(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    a, b = consumers[0], consumers[1]
    a.fault = Fault("mid_event", after=6)
    running = await _proxy(proxy, [a, b])
    async with httpx.AsyncClient(base_url=running.url, timeout=20) as client:
        resp = await client.post("/v1/completions", json=_body("completions"))
    blocks = resp.content.split(b"\n\n")
    assert blocks[-1] == b""
    assert blocks[-2] == b"data: [DONE]"
    assert all(x.startswith(b"data: {") for x in blocks[:-2])  # no half event anywhere


async def test_a_disaggregated_stream_continues_on_a_consumer_alone(
    proxy: ProxyFactory, fake: FakeFactory, consumers: list[GreedyConsumer]
) -> None:
    """The first leg fetches the producer's KV; the continuation prefills by itself (the
    producer's supply was for the original prompt only)."""
    producer = await fake("p")
    a, b = consumers[0], consumers[1]
    a.fault = Fault("reset", after=5)
    backends = [backend_entry(producer, "producer")] + [
        {"name": c.name, "url": c.url, "role": "consumer"} for c in (a, b)
    ]
    settings = quick_settings(backends, failover={"max_migrations": 1})
    running = await proxy(settings, router=InOrder())
    body = _body("completions")
    events, done = await _stream(running, "completions", body)
    assert done == 1
    assert _text(events) == _expected("completions", body)
    assert len(producer.producer_legs()) == 1
    assert "kv_transfer_params" in a.bodies[-1]
    assert "kv_transfer_params" not in b.bodies[-1]
    await _nothing_held(running, consumers)


async def test_before_the_first_byte_the_existing_retry_serves_and_failover_follows(
    proxy: ProxyFactory, consumers: list[GreedyConsumer]
) -> None:
    """Scenario 'before the first byte': a dead first consumer is the consumer phase's retry;
    the consumer that answers is then followed and may itself migrate (to the third)."""
    a, b, c = consumers
    b.fault = Fault("reset", after=6)
    running = await _proxy(proxy, consumers, migrations=1)
    await a.stop()
    body = _body("chat", stream_options={"include_usage": True})
    events, done = await _stream(running, "chat", body)
    assert done == 1
    assert _text(events) == _expected("chat", body)
    assert events[0]["id"].endswith("-b-1")
    assert c.bodies[-1]["max_tokens"] == TOKENS - 6
    assert _migrations(running, "migrated") == 1
    await _nothing_held(running, consumers)

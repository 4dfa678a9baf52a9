"""A request's TTFT class and target: its key's class; another class or a target of its own only
from a trusted key (a class is a claim on the pool's capacity). Shed requests get 429 with
Retry-After at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from starlette.datastructures import Headers

from pdproxy.errors import ClientRequestError, Overloaded
from pdproxy.front.intake import (
    ANONYMOUS,
    TTFT_CLASS_HEADER,
    TTFT_TARGET_HEADER,
    Caller,
    LatencyAsk,
    latency_ask,
)
from pdproxy.routing.base import BackendView, RequestOutcome, RouteDecision, RouteRequest
from pdproxy.routing.simple import RoundRobinRouter
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

BATCH = Caller(trusted=False, tenant=None, sees_cached_tokens=False, ttft_class="batch")
TRUSTED = Caller(trusted=True, tenant=None, sees_cached_tokens=False, ttft_class="batch")


def test_an_untrusted_caller_gets_its_keys_class_whatever_it_asks() -> None:
    asked = Headers({TTFT_CLASS_HEADER: "interactive", TTFT_TARGET_HEADER: "1"})
    assert latency_ask(asked, BATCH) == LatencyAsk("batch", None)
    assert latency_ask(asked, ANONYMOUS) == LatencyAsk(None, None)


def test_a_trusted_caller_may_name_a_class_and_a_target() -> None:
    assert latency_ask(Headers({}), TRUSTED) == LatencyAsk("batch", None)
    headers = Headers({TTFT_CLASS_HEADER: "interactive", TTFT_TARGET_HEADER: "250"})
    assert latency_ask(headers, TRUSTED) == LatencyAsk("interactive", 250.0)
    assert latency_ask(Headers({TTFT_TARGET_HEADER: "900.5"}), TRUSTED) == LatencyAsk(
        "batch", 900.5
    )


@pytest.mark.parametrize("target", ["0", "-5", "nan", "inf", "1e12", "soon", ""])
def test_a_malformed_target_is_refused(target: str) -> None:
    with pytest.raises(ClientRequestError) as caught:
        latency_ask(Headers({TTFT_TARGET_HEADER: target}), TRUSTED)
    assert caught.value.status == 400


@pytest.mark.parametrize("name", ["", "x" * 65, "bad\x01name"])
def test_a_malformed_class_is_refused(name: str) -> None:
    with pytest.raises(ClientRequestError):
        latency_ask(Headers(raw=[(TTFT_CLASS_HEADER.encode(), name.encode("latin-1"))]), TRUSTED)


class SheddingRouter:
    """Round robin for interactive requests; batch ones are shed (as the KV router does when
    no candidate is predicted to meet their target). Keeps what each request asked."""

    def __init__(self) -> None:
        self._inner = RoundRobinRouter()
        self.asked: list[tuple[str | None, float | None]] = []

    async def start(self) -> None:
        return None

    async def route(
        self, request: RouteRequest, producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision[Any]:  # fmt: skip
        self.asked.append((request.ttft_class, request.ttft_target_ms))
        if request.ttft_class == "batch":
            raise Overloaded("no backend is predicted to serve it in time", 3)
        return await self._inner.route(request, producers, consumers)

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None


_KEYS = [
    {"key": "interactive-key-0123456789", "ttft_class": "interactive"},
    {"key": "batch-key-0123456789", "ttft_class": "batch"},
    {"key": "trusted-key-0123456789", "trusted": True},
]


async def test_keys_carry_their_class_and_shed_requests_get_429_at_once(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0, c0 = await fake("p0"), await fake("c0")
    router = SheddingRouter()
    running = await proxy(
        quick_settings(
            [backend_entry(p0, "producer"), backend_entry(c0, "consumer")], api_keys=_KEYS
        ),
        router=router,
    )
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    async with running.client() as client:
        ok = await client.post(
            "/v1/completions", json=body,
            headers={"authorization": f"Bearer {_KEYS[0]['key']}", TTFT_TARGET_HEADER: "1"},
        )  # fmt: skip
        shed = await client.post(
            "/v1/completions", json=body,
            headers={"authorization": f"Bearer {_KEYS[1]['key']}",
                     TTFT_CLASS_HEADER: "interactive"},
        )  # fmt: skip
        own = await client.post(
            "/v1/completions", json=body,
            headers={"authorization": f"Bearer {_KEYS[2]['key']}", TTFT_TARGET_HEADER: "300"},
        )  # fmt: skip
    assert ok.status_code == 200 and own.status_code == 200
    assert shed.status_code == 429 and shed.headers["retry-after"] == "3"
    assert shed.json()["error"]["code"] == "overloaded"
    # The untrusted keys' headers changed nothing; the trusted key's target counted.
    assert router.asked == [("interactive", None), ("batch", None), (None, 300.0)]


def test_a_key_naming_an_unknown_class_is_refused_at_load() -> None:
    from pydantic import ValidationError

    from pdproxy.settings import ProxySettings

    with pytest.raises(ValidationError, match="TTFT classes"):
        ProxySettings(api_keys=[{"key": "k" * 20, "ttft_class": "interactiv"}])  # type: ignore[list-item]
    ProxySettings(api_keys=[{"key": "k" * 20, "ttft_class": "batch"}])  # type: ignore[list-item]

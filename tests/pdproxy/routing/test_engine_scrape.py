"""The engine-load scraper against small real HTTP servers: well-behaved, slow, dripping, huge,
malformed, vanishing and absent backends (the attacker plays the backend); then end to end
through ``build_kv_router``: the scraped load steers the decision."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.routing.base import Role
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.engine_scrape import EngineLoadScraper, ScrapeTarget
from pdproxy.routing.kv.scorers.engine_load import EngineLoadReadings, EngineLoadScorer
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import EngineLoadSettings

from .kv_helpers import BS, SEED, Backend, prompt_text, text_request

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def page(waiting: int, running: int) -> bytes:
    return (
        b"# TYPE vllm:num_requests_waiting gauge\n"
        + b'vllm:num_requests_waiting{engine="0",model_name="m"} %d\n' % waiting
        + b'vllm:num_requests_running{engine="0",model_name="m"} %d\n' % running
    )


@dataclass
class FakeBackend:
    """A real HTTP server on a free port whose ``/metrics`` misbehaves as told."""

    mode: str
    body: bytes = field(default_factory=lambda: page(0, 0))
    url: str = ""
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.mode == "vanishing":
                return
            await reader.readuntil(b"\r\n\r\n")
            if self.mode == "slow":
                await reader.read()  # until the client hangs up
            elif self.mode == "ok":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(self.body))
                writer.write(self.body)
            elif self.mode == "status":
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
            elif self.mode == "malformed":
                writer.write(b"\x00\xffnot http at all\r\n\r\n")
            elif self.mode == "declared-huge":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000\r\n\r\n")
                await reader.read()
            elif self.mode in ("huge", "drip"):
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
                chunk = b"x" * (65536 if self.mode == "huge" else 1)
                while True:  # endless: the client must hang up
                    writer.write(chunk)
                    await writer.drain()
                    self.sent += len(chunk)
                    await asyncio.sleep(0 if self.mode == "huge" else 0.02)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.hung_up.set()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def serving(*backends: FakeBackend) -> AsyncIterator[None]:
    servers = []
    for b in backends:
        server = await asyncio.start_server(b.handle, "127.0.0.1", 0)
        b.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        servers.append(server)
    try:
        yield
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


def absent_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connection refused


SETTINGS = EngineLoadSettings(enabled=True, timeout_s=0.5, max_bytes=1 << 20, concurrency=3)


async def own_none(node: str) -> int:
    return 0


async def test_hostile_backends_cost_one_timeout_and_no_memory() -> None:
    modes = ["ok", "slow", "drip", "huge", "declared-huge", "malformed", "vanishing", "status"]
    fakes = {m: FakeBackend(m, page(2, 3)) for m in modes}
    results: dict[str, str] = {}
    readings = EngineLoadReadings(max_age_s=10.0)
    async with serving(*fakes.values()):
        targets = [ScrapeTarget(m, f.url) for m, f in fakes.items()]
        targets.append(ScrapeTarget("absent", absent_url()))
        scraper = EngineLoadScraper(
            SETTINGS, lambda: targets, readings, own_none,
            on_result=results.__setitem__,
        )  # fmt: skip
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        await asyncio.wait_for(scraper.scrape_once(), timeout=30)
        tick.cancel()
        await asyncio.gather(tick, return_exceptions=True)
        await asyncio.wait_for(fakes["huge"].hung_up.wait(), timeout=10)
    assert results == {
        "ok": "ok",
        "slow": "timeout",
        "drip": "timeout",
        "huge": "too_large",
        "declared-huge": "too_large",
        "malformed": "transport",
        "vanishing": "transport",
        "status": "status",
        "absent": "transport",
    }
    assert readings.nodes() == ["ok"]
    ok = readings.latest("ok")
    assert ok is not None and (ok.sample.waiting, ok.sample.running) == (2, 3)
    assert ticks > 0  # the event loop kept running while the slow ones were waited for
    # The client hung up soon after the cap: the server never got far past it.
    assert fakes["huge"].sent < 64 * SETTINGS.max_bytes


async def test_a_page_without_load_and_a_backend_that_goes_away() -> None:
    good = FakeBackend("ok", page(1, 1))
    junk = FakeBackend("ok", b"<html>hello</html>")
    results: list[tuple[str, str]] = []
    readings = EngineLoadReadings(max_age_s=10.0)
    targets = []
    async with serving(good, junk):
        targets[:] = [ScrapeTarget("good", good.url), ScrapeTarget("junk", junk.url)]
        scraper = EngineLoadScraper(
            SETTINGS, lambda: targets, readings, own_none,
            on_result=lambda node, result: results.append((node, result)),
        )  # fmt: skip
        await scraper.scrape_once()
        assert sorted(results) == [("good", "ok"), ("junk", "no_load")]
        assert readings.nodes() == ["good"]
        targets[:] = []  # removed from the registry: its reading goes too
        await scraper.scrape_once()
        assert readings.nodes() == []


async def test_own_in_flight_is_read_after_each_answer() -> None:
    fake = FakeBackend("ok", page(0, 7))
    readings = EngineLoadReadings(max_age_s=10.0)

    async def own(node: str) -> int:
        return {"c0": 4}[node]

    async with serving(fake):
        scraper = EngineLoadScraper(SETTINGS, lambda: [ScrapeTarget("c0", fake.url)], readings, own)
        await scraper.scrape_once()
    r = readings.latest("c0")
    assert r is not None and r.own_in_flight == 4


@dataclass
class RegisteredBackend:
    name: str
    url: str
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_listen: bool = False


class Registry:
    def __init__(self, backends: list[RegisteredBackend]) -> None:
        self.backends = backends

    def all(self) -> list[RegisteredBackend]:
        return list(self.backends)


@pytest.mark.parametrize("enabled", [True, False])
async def test_scraped_queue_steers_the_router(enabled: bool) -> None:
    """Two equal consumers; another client queued 20 requests on c0 directly. With engine
    load on, the router sends the request to c1; off, it cannot tell them apart (c0 by name)."""
    busy = FakeBackend("ok", page(12, 8))
    idle = FakeBackend("ok", page(0, 0))
    async with serving(busy, idle):
        registry = Registry([RegisteredBackend("c0", busy.url), RegisteredBackend("c1", idle.url)])
        settings = KvRouterSettings(
            model_seed=SEED,
            block_size=BS,
            engine_load=EngineLoadSettings(enabled=enabled, interval_s=0.05),
        )
        router = build_kv_router(settings, backends=registry, metrics_registry=CollectorRegistry())
        await router.start()
        try:
            if enabled:
                for _ in range(200):
                    if len(router.scorer(EngineLoadScorer).readings.nodes()) == 2:
                        break
                    await asyncio.sleep(0.05)
                assert router.scorer(EngineLoadScorer).readings.nodes() == ["c0", "c1"]
            cons = [Backend("c0", Role.CONSUMER, busy.url), Backend("c1", Role.CONSUMER, idle.url)]
            decision = await router.route(text_request(prompt_text(1)), [], cons)
            assert decision.consumers[0].name == ("c1" if enabled else "c0")
            row = decision.explain["consumers"][-1 if enabled else 0]
            if enabled:
                assert row["name"] == "c0" and row["engine"]["external"] == 20
                ok = router.metrics.registry.get_sample_value(
                    "pdproxy_kv_engine_scrapes_total", {"node": "c0", "result": "ok"}
                )
                assert ok is not None and ok >= 1
            else:
                assert "engine" not in row
        finally:
            await router.close()

"""A client that goes away cancels in-flight legs at once; aborts are counted on the fakes."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import orjson

from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RecordingRouter,
    RunningProxy,
    backend_entry,
    eventually,
    quick_settings,
)


class RawClient:
    """A real TCP client that sends one request and can vanish mid-flight."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def send(cls, px: RunningProxy, path: str, body: dict[str, object]) -> RawClient:
        url = urlsplit(px.url)
        assert url.hostname is not None and url.port is not None
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        raw = orjson.dumps(body)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        return cls(reader, writer)

    async def vanish(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def p2p_pair(p: object, d: object) -> list[dict[str, object]]:
    return [backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")]  # type: ignore[arg-type]


async def test_disconnect_while_queued_sends_nothing_upstream(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P", producer_delay_s=0.4)
    d = await fake("D")
    router = RecordingRouter()
    px = await proxy(
        quick_settings(p2p_pair(p, d), admission={"max_concurrent": 1, "queue_size": 4}), router
    )
    async with px.client() as c:
        first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "first"}))
        await eventually(lambda: len(p.received) == 1)
        queued = await RawClient.send(px, "/v1/completions", {"prompt": "second"})
        await eventually(lambda: px.state.admission.queue_depth == 1)
        await queued.vanish()
        await eventually(lambda: px.state.admission.queue_depth == 0)
        assert (await first).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert [r.json()["prompt"] for r in p.completions()] == ["first"]
    assert [r.json()["prompt"] for r in d.completions()] == ["first"]
    assert p.aborts == d.aborts == 0
    assert 'pdproxy_disconnect_aborts_total{stage="queue"} 1.0' in metrics
    assert px.state.admission.active == 0
    router.assert_each_finished_once()


async def test_disconnect_during_producer_leg_aborts_it_and_releases(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P", producer_delay_s=10)
    d = await fake("D")
    router = RecordingRouter()
    px = await proxy(quick_settings(p2p_pair(p, d)), router)
    client = await RawClient.send(px, "/v1/completions", {"prompt": "x"})
    await eventually(lambda: len(p.received) == 1)
    await client.vanish()
    await eventually(lambda: p.aborts == 1)
    kv_id = p.completions()[0].json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    await eventually(lambda: p.releases == [kv_id])
    assert d.received == []
    await eventually(lambda: len(router.finished_calls) == 1)
    router.assert_each_finished_once()
    assert router.finished_calls[0][1].ok is False
    assert px.state.admission.active == 0
    assert [b.in_flight for b in px.state.registry.all()] == [0, 0]


async def test_disconnect_during_consumer_leg_aborts_it_and_releases(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D", first_chunk_delay_s=10)
    router = RecordingRouter()
    px = await proxy(quick_settings(p2p_pair(p, d)), router)
    client = await RawClient.send(px, "/v1/completions", {"prompt": "x"})
    await eventually(lambda: len(d.received) == 1)
    await client.vanish()
    await eventually(lambda: d.aborts == 1)
    kv_id = p.completions()[0].json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    await eventually(lambda: p.releases == [kv_id])
    assert p.aborts == 0
    await eventually(lambda: len(router.finished_calls) == 1)
    router.assert_each_finished_once()
    assert [b.in_flight for b in px.state.registry.all()] == [0, 0]


async def test_disconnect_mid_stream_aborts_consumer_and_releases(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D", chunks=50, chunk_delay_s=0.1)
    router = RecordingRouter()
    px = await proxy(quick_settings(p2p_pair(p, d)), router)
    client = await RawClient.send(px, "/v1/completions", {"prompt": "x", "stream": True})
    head = await asyncio.wait_for(client.reader.readuntil(b"data: "), 5)
    assert head.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in head
    await client.vanish()
    await eventually(lambda: d.aborts == 1)
    await eventually(lambda: len(p.releases) == 1)
    await eventually(lambda: len(router.finished_calls) == 1)
    router.assert_each_finished_once()
    assert router.finished_calls[0][1].ok is False
    assert [b.in_flight for b in px.state.registry.all()] == [0, 0]
    async with px.client() as c:
        metrics = (await c.get("/metrics")).text
    assert 'pdproxy_disconnect_aborts_total{stage="stream"} 1.0' in metrics


async def test_nixl_disconnect_during_producer_sends_no_release(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P", producer_delay_s=10)
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]))
    client = await RawClient.send(px, "/v1/chat/completions", {"messages": []})
    await eventually(lambda: len(p.received) == 1)
    await client.vanish()
    await eventually(lambda: p.aborts == 1)
    await asyncio.sleep(0.05)
    assert p.releases == [] and d.received == []

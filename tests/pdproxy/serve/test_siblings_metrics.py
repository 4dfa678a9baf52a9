"""Merging the processes' ``/metrics`` and splitting admission limits over processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from pdproxy.app import create_app
from pdproxy.serve.metrics_merge import (
    SAMPLES_TYPE,
    families_of,
    merge_expositions,
    merge_samples,
    samples_json,
)
from pdproxy.serve.process_group import per_process_settings, process_count
from pdproxy.serve.siblings import Siblings
from pdproxy.settings import AdmissionSettings, ProxySettings
from tests.pdproxy.conftest import quick_settings


class _Gauges:
    def __init__(self, in_flight: float, breaker: float) -> None:
        self._in_flight, self._breaker = in_flight, breaker

    def collect(self) -> list[GaugeMetricFamily]:
        a = GaugeMetricFamily("pdproxy_backend_in_flight", "x", labels=["backend"])
        a.add_metric(["d"], self._in_flight)
        b = GaugeMetricFamily("pdproxy_backend_breaker_state", "x", labels=["backend"])
        b.add_metric(["d"], self._breaker)
        return [a, b]


def _exposition(requests: int, latencies: list[float], in_flight: float, breaker: float) -> str:
    return generate_latest(_registry(requests, latencies, in_flight, breaker)).decode()


def _registry(
    requests: int, latencies: list[float], in_flight: float, breaker: float
) -> CollectorRegistry:
    r = CollectorRegistry()
    c = Counter("pdproxy_requests", "x", ["route"], registry=r)
    c.labels("chat").inc(requests)
    h = Histogram("pdproxy_ttfb_seconds", "x", buckets=(0.1, 1.0), registry=r)
    for v in latencies:
        h.observe(v)
    r.register(_Gauges(in_flight, breaker))  # type: ignore[arg-type]
    return r


def _values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_counters_histograms_and_load_add_up_states_take_the_worst() -> None:
    merged = _values(
        merge_expositions(
            [_exposition(3, [0.05, 0.5], 2, 0), _exposition(4, [0.05, 5.0], 5, 2)], missing=1
        )
    )
    assert merged[("pdproxy_requests_total", (("route", "chat"),))] == 7
    assert merged[("pdproxy_ttfb_seconds_bucket", (("le", "0.1"),))] == 2
    assert merged[("pdproxy_ttfb_seconds_bucket", (("le", "1.0"),))] == 3
    assert merged[("pdproxy_ttfb_seconds_bucket", (("le", "+Inf"),))] == 4
    assert merged[("pdproxy_ttfb_seconds_count", ())] == 4
    assert merged[("pdproxy_backend_in_flight", (("backend", "d"),))] == 7
    assert merged[("pdproxy_backend_breaker_state", (("backend", "d"),))] == 2
    assert merged[("pdproxy_proxy_processes", ())] == 2
    assert merged[("pdproxy_proxy_processes_unreachable", ())] == 1


def test_one_exposition_comes_back_unchanged_but_for_the_process_count() -> None:
    text = _exposition(3, [0.05], 1, 1)
    merged = _values(merge_expositions([text]))
    own = _values(text.encode())
    assert {k: v for k, v in merged.items() if not k[0].startswith("pdproxy_proxy_")} == own


def test_admission_limits_are_split_over_the_processes_rounding_up() -> None:
    s = ProxySettings(
        admission=AdmissionSettings(max_concurrent=5, queue_size=0, max_connections=4096)
    )
    split = per_process_settings(s, 2).admission
    assert (split.max_concurrent, split.queue_size, split.max_connections) == (3, 0, 2048)
    assert (split.max_waiting_connections, split.max_waiting_per_source) == (512, 64)
    assert per_process_settings(s, 1) is s
    assert process_count(3) == 3 and process_count(0) >= 1


class _Sibling:
    """A sibling process's Unix socket answering ``GET /metrics`` (counted), in the samples
    format when asked for it."""

    def __init__(self, path: Path, registry: CollectorRegistry) -> None:
        self.path = path
        self.registry = registry
        self.scrapes = 0
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> _Sibling:
        self._server = await asyncio.start_unix_server(self._answer, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        self.scrapes += 1
        if SAMPLES_TYPE.encode() in head:
            body = samples_json(self.registry)
        else:
            body = generate_latest(self.registry)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()


async def test_scrapes_share_one_merge_until_it_is_a_second_old(tmp_path: Path) -> None:
    """An open ``/metrics`` hammered over TCP costs one fan-out and merge per second, not one
    per request (issue 30 finding 10); a scrape after that sees the siblings' new values."""
    now = [1000.0]
    app = create_app(quick_settings([]), siblings=Siblings(tmp_path, 0, 2), clock=lambda: now[0])
    transport = httpx.ASGITransport(app=app)
    async with (
        _Sibling(tmp_path / "1.sock", _registry(3, [0.5], 1, 0)) as sibling,
        httpx.AsyncClient(transport=transport, base_url="http://proxy") as client,
    ):
        scrapes = await asyncio.gather(*(client.get("/metrics") for _ in range(20)))
        for _ in range(5):
            scrapes.append(await client.get("/metrics"))
        assert sibling.scrapes == 1
        for r in scrapes:
            assert _values(r.content)[("pdproxy_requests_total", (("route", "chat"),))] == 3
        sibling.registry = _registry(5, [0.5], 1, 2)
        now[0] += 1.5
        r = await client.get("/metrics")
        assert sibling.scrapes == 2
        merged = _values(r.content)
        assert merged[("pdproxy_requests_total", (("route", "chat"),))] == 5
        assert merged[("pdproxy_ttfb_seconds_count", ())] == 1
        assert merged[("pdproxy_backend_breaker_state", (("backend", "d"),))] == 2


def test_the_samples_merge_equals_the_text_merge() -> None:
    """Siblings answer in the samples format (no text to parse): same result as the text."""
    regs = [_registry(3, [0.05, 0.5], 2, 0), _registry(4, [0.05, 5.0], 5, 2)]
    from_text = merge_expositions([generate_latest(r).decode() for r in regs], missing=1)
    from_samples = merge_samples([families_of(samples_json(r)) for r in regs], missing=1)
    assert _values(from_samples) == _values(from_text)

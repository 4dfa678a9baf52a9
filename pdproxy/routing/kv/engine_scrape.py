"""Scrape each backend's Prometheus ``/metrics`` into :class:`EngineLoadReadings` (the I/O part
of engine-reported load; the parse is :mod:`~pdproxy.routing.kv.engine_metrics_text`, the
scorer that charges it :mod:`~pdproxy.routing.kv.scorers.engine_load`).

Every ``interval_s`` (± ``jitter``) all backends are scraped, at most ``concurrency`` at once.
Threat model: a backend's ``/metrics`` answer is untrusted input (a broken or compromised
backend, or whatever answers on its address). It can make the router charge that backend more
or less (it could do as much by answering slowly), never stall the event loop or grow the
proxy's memory: each scrape is bounded as a whole by ``timeout_s`` (a slow drip included), the
body is read raw (``accept-encoding: identity``, so no decompression bomb) and abandoned past
``max_bytes``, large bodies are parsed in a thread, and only finite, non-negative values of the
few wanted series are read. A failed scrape leaves the previous reading to age out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

from pdproxy.routing.kv.engine_metrics_text import EngineSample, parse_engine_metrics
from pdproxy.routing.kv.scorers.engine_load import EngineLoadReadings, EngineReading
from pdproxy.settings.scorers import EngineLoadSettings

logger = logging.getLogger(__name__)

_INLINE_PARSE_BYTES = 256 * 1024
"""Bodies up to this are parsed on the event loop (well under a millisecond); larger ones in a
thread."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    name: str
    url: str
    """The backend's base URL; the settings' ``path`` is appended."""


class ScrapeFailed(Exception):
    """One scrape gave no reading; ``kind`` is the metric label."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class EngineLoadScraper:
    def __init__(
        self,
        settings: EngineLoadSettings,
        targets: Callable[[], Sequence[ScrapeTarget]],
        readings: EngineLoadReadings,
        own_in_flight: Callable[[str], Awaitable[int]],
        *,
        on_result: Callable[[str, str], None] = lambda node, result: None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """``own_in_flight(node)``: this proxy's requests in flight on ``node`` now (read
        right after the node's answer, so both figures describe the same moment).
        ``on_result(node, result)``: ``ok`` or a :class:`ScrapeFailed` kind, per scrape."""
        self._settings = settings
        self._targets = targets
        self.readings = readings
        self._own = own_in_flight
        self._on_result = on_result
        self._clock = clock
        self._rng = rng or random.Random()
        self._failing: set[str] = set()

    def _client(self) -> httpx.AsyncClient:
        s = self._settings
        return httpx.AsyncClient(
            timeout=httpx.Timeout(s.timeout_s),
            limits=httpx.Limits(max_connections=s.concurrency, max_keepalive_connections=64),
            headers={"accept-encoding": "identity", "accept": "text/plain"},
            follow_redirects=False,
        )

    async def run(self) -> None:
        """Scrape every interval until cancelled."""
        s = self._settings
        async with self._client() as client:
            while True:
                await self.scrape_round(client)
                spread = 1.0 + s.jitter * (2.0 * self._rng.random() - 1.0)
                await asyncio.sleep(s.interval_s * spread)

    async def scrape_once(self) -> None:
        """One round with a client of its own (tests, a first reading at start)."""
        async with self._client() as client:
            await self.scrape_round(client)

    async def scrape_round(self, client: httpx.AsyncClient) -> None:
        targets = list(self._targets())
        wanted = {t.name for t in targets}
        for node in self.readings.nodes():
            if node not in wanted:
                self.readings.drop(node)
        gate = asyncio.Semaphore(self._settings.concurrency)

        async def one(target: ScrapeTarget) -> None:
            async with gate:
                await self._scrape_node(client, target)

        await asyncio.gather(*(one(t) for t in targets))

    async def _scrape_node(self, client: httpx.AsyncClient, target: ScrapeTarget) -> None:
        try:
            sample = await self._fetch(client, target)
            own = await self._own(target.name)
        except ScrapeFailed as exc:
            self._failed(target.name, exc.kind, str(exc))
            return
        except Exception as exc:  # a bug or a foreign failure must not end the loop
            logger.exception("engine load: scraping %s failed", target.name)
            self._failed(target.name, "error", repr(exc))
            return
        self.readings.put(target.name, EngineReading(sample, own, self._clock()))
        self._on_result(target.name, "ok")
        if target.name in self._failing:
            self._failing.discard(target.name)
            logger.info("engine load: %s answers again", target.name)

    def _failed(self, node: str, kind: str, detail: str) -> None:
        self._on_result(node, kind)
        if node not in self._failing:
            self._failing.add(node)
            logger.warning("engine load: no reading from %s (%s)", node, detail)

    async def _fetch(self, client: httpx.AsyncClient, target: ScrapeTarget) -> EngineSample:
        s = self._settings
        url = target.url.rstrip("/") + s.path
        try:
            async with asyncio.timeout(s.timeout_s):
                body = await self._read_capped(client, url)
        except TimeoutError as exc:
            raise ScrapeFailed("timeout", f"no answer within {s.timeout_s}s") from exc
        except httpx.HTTPError as exc:
            raise ScrapeFailed("transport", repr(exc)) from exc
        if len(body) > _INLINE_PARSE_BYTES:
            sample = await asyncio.to_thread(parse_engine_metrics, body)
        else:
            sample = parse_engine_metrics(body)
        if sample is None:
            raise ScrapeFailed("no_load", "no request counts in the answer")
        return sample

    async def _read_capped(self, client: httpx.AsyncClient, url: str) -> bytes:
        cap = self._settings.max_bytes
        async with client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise ScrapeFailed("status", f"HTTP {resp.status_code}")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise ScrapeFailed("too_large", f"content-length {declared} > {cap}")
            body = bytearray()
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > cap:
                    raise ScrapeFailed("too_large", f"more than {cap} bytes")
            return bytes(body)

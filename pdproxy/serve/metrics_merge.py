"""``GET /metrics`` of a ``pdproxy serve --workers N`` group: every process's metrics as one.

The process a scrape reaches collects its own samples, asks each sibling for theirs over the
private Unix sockets (:mod:`pdproxy.serve.siblings`), adds them up (:func:`merge_samples`) and
answers the text exposition. Siblings answer in :data:`SAMPLES_TYPE` (the collected samples as
JSON, 3.3 ms) rather than in the text format (7.5 ms to write, 15 ms to parse): with a proxy's
series for 24 backends (94 KiB a process), a merge of 2 processes took 43 ms of CPU from text
and takes 13 ms from samples; of 16 processes, 300 ms and 47 ms. One process's ``/metrics``
costs 7.5 ms.

:class:`MergedMetrics` answers every scrape from one merge at most ``metrics_cache_s`` old (a
scrape arriving during a merge waits for it), so however often ``/metrics`` (which is open) is
hit, each process merges at most once per interval; the merge itself runs in a worker thread.

Why not ``prometheus_client``'s multiprocess mode (values in shared mmap files, summed at
scrape time, no fan-out): it needs a process-wide registry and environment set before import
(this package keeps one registry per app), cannot carry custom collectors (the live backend and
admission gauges, the routers' collectors), and doubles the hot path's metric cost (a counter
``inc`` plus a histogram ``observe``: 1.3 µs in memory, 2.6 µs on mmap, on every request). Its
scrape of the same series costs 11.5 ms (2 processes) to 40 ms (16), about the samples merge,
which the cache runs at most once per interval.
Figures: ``python -m tests.pdproxy.serve.measure_metrics_merge`` (2 shared cores).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdproxy.serve.siblings import Siblings

log = logging.getLogger(__name__)

SAMPLES_TYPE = "application/vnd.pdproxy.samples+json"
"""What a sibling's ``/metrics`` answers when asked for it (``Accept``) over its Unix socket."""

ADDITIVE_GAUGES = frozenset(
    {"pdproxy_backend_in_flight", "pdproxy_queue_depth", "pdproxy_waiting_connections"}
)
"""Gauges that count per-process things (summed); every other gauge describes a state each
process sees for itself (breaker, health, index size): the largest value is reported."""

Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]
"""name, documentation, type, unit, samples (name, labels, value): one metric family."""


def _plain(f: Metric) -> Family:
    return f.name, f.documentation, f.type, f.unit, [(s.name, s.labels, s.value) for s in f.samples]


def collected(registry: CollectorRegistry) -> list[Family]:
    """This process's metrics as plain data. On the event loop: collectors read live state."""
    return [_plain(f) for f in registry.collect()]


def samples_json(registry: CollectorRegistry) -> bytes:
    """The :data:`SAMPLES_TYPE` answer (NaN and infinities become null, read back as NaN)."""
    return orjson.dumps(collected(registry))


def families_of(raw: bytes) -> list[Family]:
    """A :data:`SAMPLES_TYPE` answer read back."""
    families: list[Family] = []
    for name, doc, kind, unit, samples in orjson.loads(raw):
        families.append(
            (name, doc, kind, unit,
             [(s, labels, math.nan if v is None else float(v)) for s, labels, v in samples])
        )  # fmt: skip
    return families


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_samples(processes: list[list[Family]], missing: int = 0) -> bytes:
    """The processes' metrics, merged into one text exposition: counters, histograms and the
    :data:`ADDITIVE_GAUGES` summed per label set, other gauges the maximum, ``_created`` the
    earliest. Adds ``pdproxy_proxy_processes`` (answered) and ``..._unreachable``. Pure: runs
    in a worker thread."""
    merged: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for families in processes:
        for name, doc, kind, unit, samples in families:
            out = merged.get(name)
            if out is None:
                out = merged[name] = Metric(name, doc, kind, unit)
            keep_max = kind == "gauge" and name not in ADDITIVE_GAUGES
            for sample, labels, value in samples:
                key = (name, sample, tuple(sorted(labels.items())))
                old = values.get(key)
                if old is None:
                    values[key] = value
                    out.samples.append(Sample(sample, dict(labels), math.nan))
                elif sample.endswith("_created"):
                    values[key] = min(old, value)
                elif keep_max:
                    values[key] = max(old, value)
                else:
                    values[key] = old + value
    for family in merged.values():
        family.samples = [
            s._replace(value=values[(family.name, s.name, tuple(sorted(s.labels.items())))])
            for s in family.samples
        ]
    up = Metric("pdproxy_proxy_processes", "Proxy processes whose metrics are included", "gauge")
    up.add_sample("pdproxy_proxy_processes", {}, float(len(processes)))
    lost = Metric(
        "pdproxy_proxy_processes_unreachable",
        "Proxy processes that did not answer this scrape",
        "gauge",
    )
    lost.add_sample("pdproxy_proxy_processes_unreachable", {}, float(missing))
    return generate_latest(_Families([*merged.values(), up, lost]))


def merge_expositions(texts: list[str], missing: int = 0) -> bytes:
    """:func:`merge_samples` of text expositions (parsed first)."""
    processes = [[_plain(f) for f in text_string_to_metric_families(text)] for text in texts]
    return merge_samples(processes, missing)


class MergedMetrics:
    """The group's ``/metrics`` for scrapes over the shared port of one process.

    Called on the event loop by the ``/metrics`` route. A merge's result serves every scrape
    for ``max_age_s`` after the merge began; scrapes during a merge share it; a scrape that
    leaves (client gone) does not cancel it."""

    def __init__(
        self,
        siblings: Siblings,
        registry: CollectorRegistry,
        *,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._siblings = siblings
        self._registry = registry
        self._max_age_s = max_age_s
        self._clock = clock
        self._body: bytes | None = None
        self._taken_at = -math.inf
        self._pending: asyncio.Future[bytes] | None = None

    async def scrape(self) -> bytes:
        if self._body is not None and self._clock() - self._taken_at < self._max_age_s:
            return self._body
        if self._pending is None:
            pending = self._pending = asyncio.ensure_future(self._merge())
            pending.add_done_callback(self._merged)
        return await asyncio.shield(self._pending)

    def _merged(self, done: asyncio.Future[bytes]) -> None:
        self._pending = None
        if not done.cancelled() and done.exception() is not None:
            log.error("merging the proxy processes' metrics failed", exc_info=done.exception())

    async def _merge(self) -> bytes:
        started = self._clock()
        processes = [collected(self._registry)]
        answers = await self._siblings.fan_out("GET", "/metrics", {"accept": SAMPLES_TYPE})
        missing = 0
        for answer in answers:
            families = _decoded(answer)
            if families is None:
                missing += 1
            else:
                processes.append(families)
        body = await asyncio.to_thread(merge_samples, processes, missing)
        self._body, self._taken_at = body, started
        return body


def _decoded(answer: tuple[int, bytes] | None) -> list[Family] | None:
    if answer is None or answer[0] != 200:
        return None
    try:
        return families_of(answer[1])
    except (ValueError, TypeError) as exc:
        log.warning("a proxy process answered unreadable metrics: %s", exc)
        return None

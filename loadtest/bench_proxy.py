"""pdproxy overhead, side by side with its floor, in one run.

Floor: the load generator itself calls the producer (non-stream, one token), reads its
``kv_transfer_params`` and calls the consumer, i.e. a zero-cost proxy. Proxy: the same requests
through ``pdproxy serve``. Backends are instant fakes (``loadtest.fake_backend``) in their own
process; pdproxy runs in its own process so its CPU time is measured from ``/proc``.

For non-stream and a 64-chunk stream at concurrency 1, 16 and 64, prints req/s, p50/p99
latency, p50 time to first chunk (TTFC), proxy CPU ms per request, and the ratios against the
floor. Bounded: each cell runs for ``--duration`` seconds or ``--max-requests`` requests.

``--baseline-tree DIR`` also runs a second proxy from another checkout (e.g. the code before a
change) in the same run, each of its cells right before the same cell of this tree's proxy, and
prints this proxy's CPU per request as a ratio of the baseline's: on a noisy machine a before /
after comparison is only meaningful within one run. ``--rounds N`` runs each cell N times,
alternating the modes (floor, baseline, proxy), and adds them up, so load drift hits every mode
alike.

``--trace`` makes this tree's proxy trace every request (OpenTelemetry, exported over OTLP/HTTP
to a sink in the load generator's process, whose CPU is not the proxy's). With
``--baseline-tree .`` the baseline is the same code untraced, so the CPU ratio is tracing's cost.

    python -m loadtest.bench_proxy [--duration 2] [--max-requests 4000] [--rounds 1]
        [--baseline-tree DIR] [--trace]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import aiohttp
import orjson

from loadtest.child import child_process
from loadtest.otlp_sink import OtlpSink
from pdproxy.stack.ports import free_port

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass(frozen=True, slots=True)
class Cell:
    mode: str
    kind: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    ttfc_p50_ms: float
    proxy_cpu_ms: float | None
    client_cpu_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _read(resp: aiohttp.ClientResponse, t0: float) -> float:
    """Read a whole response; return the time of its first body chunk."""
    first = 0.0
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            return first or time.perf_counter() - t0
        if not first:
            first = time.perf_counter() - t0


class Load:
    def __init__(self, session: aiohttp.ClientSession, p: str, d: str, proxy: str) -> None:
        self.session = session
        self.p, self.d, self.proxy = p, d, proxy
        self.body = {"model": "fake-model", "prompt": "the quick brown fox " * 20, "top_p": 0.9}

    def _client_body(self, stream: bool) -> dict[str, object]:
        return {**self.body, "max_tokens": 64, "stream": stream}

    async def floor(self, stream: bool) -> float:
        t0 = time.perf_counter()
        client = self._client_body(stream)
        producer = {**client, "stream": False, "max_tokens": 1, "kv_transfer_params": _NIXL}
        async with self.session.post(
            self.p + "/v1/completions", data=orjson.dumps(producer), headers=_JSON
        ) as resp:
            kvp = orjson.loads(await resp.read())["kv_transfer_params"]
        consumer = {**client, "kv_transfer_params": kvp}
        async with self.session.post(
            self.d + "/v1/completions", data=orjson.dumps(consumer), headers=_JSON
        ) as resp:
            return await _read(resp, t0)

    async def via_proxy(self, stream: bool) -> float:
        t0 = time.perf_counter()
        async with self.session.post(
            self.proxy + "/v1/completions", data=orjson.dumps(self._client_body(stream)),
            headers=_JSON,
        ) as resp:  # fmt: skip
            if resp.status != 200:
                raise RuntimeError(f"proxy answered {resp.status}")
            return await _read(resp, t0)


_JSON = {"content-type": "application/json"}
_NIXL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def _run_cell(
    call: Callable[[], Awaitable[float]],
    concurrency: int,
    duration: float,
    max_requests: int,
) -> tuple[list[float], list[float], int, float]:
    latencies: list[float] = []
    ttfcs: list[float] = []
    errors = 0
    started = 0
    t_start = time.perf_counter()
    deadline = t_start + duration

    async def worker() -> None:
        nonlocal errors, started
        while time.perf_counter() < deadline and started < max_requests:
            started += 1
            t0 = time.perf_counter()
            try:
                ttfcs.append(await call())
                latencies.append(time.perf_counter() - t0)
            except (aiohttp.ClientError, RuntimeError, TimeoutError):
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, ttfcs, errors, time.perf_counter() - t_start


async def _wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(400):
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never became ready")


@dataclass
class _Sum:
    """One cell's rounds added up."""

    lat: list[float] = field(default_factory=list)
    ttfc: list[float] = field(default_factory=list)
    errors: int = 0
    secs: float = 0.0
    cpu: float = 0.0
    own: float = 0.0

    def add(
        self, lat: list[float], ttfc: list[float], *, errors: int, secs: float, cpu: float,
        own: float,
    ) -> None:  # fmt: skip
        self.lat += lat
        self.ttfc += ttfc
        self.errors += errors
        self.secs += secs
        self.cpu += cpu
        self.own += own

    def cell(self, mode: str, kind: str, conc: int) -> Cell:
        n = len(self.lat)
        return Cell(
            mode, kind, conc, n, self.errors, self.secs,
            _pct(self.lat, 0.5) * 1e3, _pct(self.lat, 0.99) * 1e3,
            statistics.median(self.ttfc) * 1e3 if self.ttfc else float("nan"),
            self.cpu * 1e3 / n if mode != "floor" and n else None,
            self.own * 1e3 / n if n else float("nan"),
        )  # fmt: skip


def _proxy_argv(port: int, p_url: str, d_url: str) -> list[str]:
    return [sys.executable, "-m", "pdproxy.cli", "serve", "--port", str(port),
            "--producer", p_url, "--consumer", d_url, "--dialect", "nixl",
            "--log-level", "warning"]  # fmt: skip


async def _bench(args: argparse.Namespace) -> list[Cell]:
    p_port, d_port, x_port, b_port = free_port(), free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    proxy_url, baseline_url = f"http://127.0.0.1:{x_port}", f"http://127.0.0.1:{b_port}"
    # One process each: CPU per request compares like with like (a tree without --workers
    # ignores the variable).
    env = {**os.environ, "PDPROXY_HEALTH__ENABLED": "false", "PDPROXY_WORKERS": "1"}
    backends = [sys.executable, "-m", "loadtest.fake_backend", "--chunks", "64",
                "--listen", f"P={p_port}", "--listen", f"D={d_port}"]  # fmt: skip
    baseline_tree: str | None = args.baseline_tree
    modes = ("floor", "baseline", "pdproxy") if baseline_tree else ("floor", "pdproxy")
    cells: list[Cell] = []
    sink = await OtlpSink().start() if args.trace else None
    proxy_env = env
    if sink is not None:
        # Exports every 200 ms; the last flush at shutdown (the sink is gone by then) gives up
        # after 1 s instead of 10.
        proxy_env = {
            **env,
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1000",
        }
    with contextlib.ExitStack() as stack:
        stack.enter_context(child_process(backends))
        argv = _proxy_argv(x_port, p_url, d_url)
        pids = {"pdproxy": stack.enter_context(child_process(argv, env=proxy_env))}
        if baseline_tree:
            # ``-m`` puts the working directory first on sys.path: run it from the other tree.
            old_env = {**env, "PYTHONPATH": baseline_tree}
            argv = _proxy_argv(b_port, p_url, d_url)
            pids["baseline"] = stack.enter_context(
                child_process(argv, env=old_env, cwd=baseline_tree)
            )
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            await _wait_ready(session, p_url + "/health")
            await _wait_ready(session, d_url + "/health")
            await _wait_ready(session, proxy_url + "/ready")
            loads = {"pdproxy": Load(session, p_url, d_url, proxy_url)}
            if baseline_tree:
                await _wait_ready(session, baseline_url + "/ready")
                loads["baseline"] = Load(session, p_url, d_url, baseline_url)
            for stream in (False, True):  # warm up every path and connection pool
                for load in loads.values():
                    await _run_cell(partial(load.floor, stream), 8, 0.5, 200)
                    await _run_cell(partial(load.via_proxy, stream), 8, 0.5, 200)
            for stream in (False, True):
                kind = "stream64" if stream else "nonstream"
                for conc in args.concurrency:
                    # Rounds alternate the modes so that load drift on a shared machine hits
                    # each mode alike; a cell sums its rounds.
                    sums: dict[str, _Sum] = {mode: _Sum() for mode in modes}
                    for _ in range(args.rounds):
                        for mode in modes:
                            load = loads.get(mode, loads["pdproxy"])
                            call = load.floor if mode == "floor" else load.via_proxy
                            proc = pids.get(mode, pids["pdproxy"])
                            cpu0 = _cpu_seconds(proc.pid)
                            own0 = time.process_time()
                            lat, ttfc, errors, secs = await _run_cell(
                                partial(call, stream), conc, args.duration, args.max_requests
                            )
                            sums[mode].add(
                                lat, ttfc, errors=errors, secs=secs,
                                cpu=_cpu_seconds(proc.pid) - cpu0,
                                own=time.process_time() - own0,
                            )  # fmt: skip
                    cells.extend(sums[mode].cell(mode, kind, conc) for mode in modes)
        if sink is not None:
            # Stopped while this loop still runs: stopping the proxies blocks it.
            await sink.stop()
            print(f"OTLP sink: {sink.exports} exports, {sink.bytes} bytes of spans")
    return cells


def _report(cells: list[Cell]) -> None:
    print(
        f"{'kind':<10} {'c':>3} {'mode':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'TTFC ms':>8} {'CPU ms/req':>10} {'client CPU':>10} {'err':>4}"
    )
    for cell in cells:
        cpu = f"{cell.proxy_cpu_ms:.3f}" if cell.proxy_cpu_ms is not None else "-"
        print(
            f"{cell.kind:<10} {cell.concurrency:>3} {cell.mode:<8} {cell.rps:>8.0f} "
            f"{cell.p50_ms:>8.2f} {cell.p99_ms:>8.2f} {cell.ttfc_p50_ms:>8.2f} {cpu:>10} "
            f"{cell.client_cpu_ms:>10.3f} {cell.errors:>4}"
        )
    print("\nproxy vs floor (same run):")
    floors = {(c.kind, c.concurrency): c for c in cells if c.mode == "floor"}
    baselines = {(c.kind, c.concurrency): c for c in cells if c.mode == "baseline"}
    for cell in cells:
        if cell.mode != "pdproxy":
            continue
        floor = floors[(cell.kind, cell.concurrency)]
        print(
            f"  {cell.kind:<10} c={cell.concurrency:<3} req/s {_ratio(cell.rps, floor.rps)}  "
            f"p50 +{cell.p50_ms - floor.p50_ms:.2f} ms  "
            f"TTFC +{cell.ttfc_p50_ms - floor.ttfc_p50_ms:.2f} ms  "
            f"proxy CPU {cell.proxy_cpu_ms:.3f} ms/req (target <= 0.3)"
        )
    if not baselines:
        return
    print("\nthis proxy vs the baseline tree (same run; CPU ratio < 1 is cheaper):")
    for cell in cells:
        base = baselines.get((cell.kind, cell.concurrency))
        if cell.mode != "pdproxy" or base is None:
            continue
        assert cell.proxy_cpu_ms is not None and base.proxy_cpu_ms is not None
        print(
            f"  {cell.kind:<10} c={cell.concurrency:<3} CPU/req {base.proxy_cpu_ms:.3f} -> "
            f"{cell.proxy_cpu_ms:.3f} ms ({_ratio(cell.proxy_cpu_ms, base.proxy_cpu_ms)})  "
            f"req/s {_ratio(cell.rps, base.rps)}  p50 {base.p50_ms:.2f} -> {cell.p50_ms:.2f} ms"
        )


def _ratio(value: float, base: float) -> str:
    # CPU comes from /proc in clock ticks (10 ms here): a short cell can measure none at all.
    if base <= 0:
        return f"no ratio: the baseline measured 0 (a tick is {1000 / _TICKS:.0f} ms; run longer)"
    return f"x{value / base:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pdproxy vs a client-side floor")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per cell")
    parser.add_argument("--max-requests", type=int, default=4000, help="requests per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run each cell this many times, alternating the modes, and add them up",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-tree", metavar="DIR",
        help="another checkout whose proxy is measured in the same run (before/after)",
    )  # fmt: skip
    parser.add_argument(
        "--trace", action="store_true",
        help="this tree's proxy traces every request to an in-process OTLP sink",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    _report(asyncio.run(_bench(args)))


if __name__ == "__main__":
    main()

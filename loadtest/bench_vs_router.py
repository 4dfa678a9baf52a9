"""pdproxy against the Rust vllm-router, same fake backends, same run.

Starts one fake vLLM producer and one consumer (``loadtest.fake_backend``, NIXL dialect, instant
answers), ``vllm-router`` (PD mode, NIXL, round robin) and ``pdproxy serve`` (round robin) in
front of them, and measures each proxy in turn, cell by cell:

- Python client (aiohttp), non-stream, 16 tokens, c=16 and c=64: req/s, p50, p99;
- Python client, stream of 64 chunks, c=64: req/s, TTFC p50 (first body chunk), p99;
- wrk (when installed), non-stream, c=16 and c=64: req/s, p50, p99;

and for every cell the CPU time of each proxy's whole process tree per request (pdproxy with
``--workers N`` is N+1 processes, vllm-router one process with threads). Then the ratios
pdproxy / router. Bounded: each cell runs ``--duration`` seconds (or ``--max-requests``);
``--rounds N`` alternates the proxies N times per cell and adds the rounds up, so load drift on a
shared machine hits both alike.

vllm-router is a benchmark dependency only: it is installed from PyPI (``vllm-router==0.1.17``)
into a venv of its own, ``${PDPROXY_ROUTER_VENV:-.venv-router}``, the first time.

    python -m loadtest.bench_vs_router [--duration 3] [--rounds 1] [--workers 0 1]
        [--baseline-tree DIR] [--no-wrk]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp
import orjson

from loadtest.bench_proxy import _pct, _run_cell, _wait_ready
from loadtest.child import child_process
from pdproxy.stack.ports import free_port

ROUTER_VERSION = "0.1.17"
_TICKS = os.sysconf("SC_CLK_TCK")
_JSON = {"content-type": "application/json"}
_PROMPT = "the quick brown fox " * 20


def router_binary(venv: Path) -> Path:
    """``vllm-router`` from ``venv``, installed there first when missing."""
    binary = venv / "bin" / "vllm-router"
    if binary.exists():
        return binary
    print(f"installing vllm-router=={ROUTER_VERSION} into {venv} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-router=={ROUTER_VERSION}"], check=True)
    return binary


def add_router_venv_argument(parser: argparse.ArgumentParser) -> None:
    """``--router-venv``: where vllm-router is (installed there by :func:`router_binary`)."""
    parser.add_argument(
        "--router-venv", type=Path,
        default=Path(os.environ.get("PDPROXY_ROUTER_VENV", ".venv-router")),
        help="venv holding vllm-router (installed there when missing)",
    )  # fmt: skip


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants (threads included)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
    return total


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str
    pid: int


@dataclass
class Tally:
    """One (load, proxy) cell, its rounds added up."""

    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    lat: list[float] = field(default_factory=list)
    ttfc: list[float] = field(default_factory=list)
    wrk_p50: list[float] = field(default_factory=list)
    wrk_p99: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def cpu_ms(self) -> float:
        return self.cpu * 1e3 / self.requests if self.requests else float("nan")

    @property
    def p50_ms(self) -> float:
        if self.wrk_p50:
            return sorted(self.wrk_p50)[len(self.wrk_p50) // 2]
        return _pct(self.lat, 0.5) * 1e3

    @property
    def p99_ms(self) -> float:
        if self.wrk_p99:
            return sorted(self.wrk_p99)[len(self.wrk_p99) // 2]
        return _pct(self.lat, 0.99) * 1e3

    @property
    def ttfc_ms(self) -> float:
        return _pct(self.ttfc, 0.5) * 1e3 if self.ttfc else float("nan")


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """One completion; returns the time to its first body chunk."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=_JSON) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
        first = 0.0
        while True:
            chunk = await resp.content.readany()
            if not chunk:
                return first or time.perf_counter() - t0
            if not first:
                first = time.perf_counter() - t0


def _body(stream: bool, tokens: int) -> bytes:
    return orjson.dumps(
        {"model": "fake-model", "prompt": _PROMPT, "max_tokens": tokens, "stream": stream}
    )


@dataclass(frozen=True, slots=True)
class Load:
    label: str
    concurrency: int
    stream: bool = False
    tokens: int = 16
    wrk: bool = False


_LOADS = (
    Load("python c=16", 16),
    Load("python c=64", 64),
    Load("stream64 c=64", 64, stream=True, tokens=64),
    Load("wrk c=16", 16, wrk=True),
    Load("wrk c=64", 64, wrk=True),
)

_WRK_LATENCY = re.compile(r"^\s*(50|99)%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_WRK_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _wrk_script(directory: Path, tokens: int) -> Path:
    path = directory / f"post{tokens}.lua"
    body = _body(False, tokens).decode()
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = [[{body}]]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    return path


@dataclass(frozen=True, slots=True)
class WrkRun:
    requests: int
    """Answered 2xx/3xx."""
    errors: int
    """Non-2xx/3xx answers and socket errors."""
    seconds: float
    latency_ms: dict[int, float]
    """Percentile (50, 99) -> ms."""


def parse_wrk(out: str) -> WrkRun:
    """wrk's ``--latency`` report, read."""
    done = re.search(r"(\d+) requests in ([\d.]+)(ms|s)", out)
    if done is None:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    seconds = float(done.group(2)) * (1e-3 if done.group(3) == "ms" else 1.0)
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
    )
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    latency = {
        int(m.group(1)): float(m.group(2)) * _WRK_UNIT[m.group(3)]
        for m in _WRK_LATENCY.finditer(out)
    }
    return WrkRun(int(done.group(1)) - errors, errors, seconds, latency)


def _run_wrk(url: str, load: Load, duration: float, script: Path) -> WrkRun:
    argv = ["wrk", "-t2", f"-c{load.concurrency}", f"-d{max(1, round(duration))}s",
            "--latency", "-s", str(script), url + "/v1/completions"]  # fmt: skip
    out = subprocess.run(
        argv, check=False, capture_output=True, text=True, timeout=duration + 30
    ).stdout
    return parse_wrk(out)


async def _measure(
    session: aiohttp.ClientSession, target: Target, load: Load, args: argparse.Namespace,
    *, tally: Tally, wrk_script: Path | None,
) -> None:  # fmt: skip
    cpu0 = tree_cpu_seconds(target.pid)
    if load.wrk:
        assert wrk_script is not None
        run = await asyncio.to_thread(_run_wrk, target.url, load, args.duration, wrk_script)
        n, errors, secs = run.requests, run.errors, run.seconds
        tally.wrk_p50.append(run.latency_ms.get(50, float("nan")))
        tally.wrk_p99.append(run.latency_ms.get(99, float("nan")))
    else:
        call: Callable[[], Awaitable[float]] = partial(
            _post, session, target.url + "/v1/completions", _body(load.stream, load.tokens)
        )
        lat_s, ttfc, errors, secs = await _run_cell(
            call, load.concurrency, args.duration, args.max_requests
        )
        n = len(lat_s)
        tally.lat += lat_s
        if load.stream:
            tally.ttfc += ttfc
    tally.cpu += tree_cpu_seconds(target.pid) - cpu0
    tally.requests += n
    tally.errors += errors
    tally.seconds += secs


def _pdproxy_argv(port: int, p_url: str, d_url: str, workers: int) -> list[str]:
    return [sys.executable, "-m", "pdproxy.cli", "serve", "--port", str(port),
            "--producer", p_url, "--consumer", d_url, "--dialect", "nixl",
            "--router", "round_robin", "--workers", str(workers),
            "--log-level", "warning"]  # fmt: skip


def _router_argv(binary: Path, port: int, p_url: str, d_url: str) -> list[str]:
    return [str(binary), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill", p_url, "--decode", d_url, "--policy", "round_robin",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            # Its metrics listener on a free port too (a fixed default clashes with any other
            # router on the machine, a previous run's included).
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--max-concurrent-requests", "1024", "--queue-size", "1024"]  # fmt: skip


@contextlib.contextmanager
def _quiet_process(argv: list[str], env: dict[str, str], cwd: str | None = None) -> Iterator[int]:
    with child_process(argv, env=env, cwd=cwd) as proc:
        yield proc.pid


Results = dict[tuple[str, str], Tally]


async def _bench(args: argparse.Namespace) -> tuple[list[Load], list[str], Results]:
    p_port, d_port = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    env = {**os.environ, "PDPROXY_HEALTH__ENABLED": "false"}
    env.pop("PDPROXY_WORKERS", None)
    backends = [sys.executable, "-m", "loadtest.fake_backend",
                "--listen", f"P={p_port}", "--listen", f"D={d_port}"]  # fmt: skip
    loads = [load for load in _LOADS if not load.wrk or args.wrk]
    results: Results = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        stack.enter_context(child_process(backends))
        targets: list[Target] = []
        port = free_port()
        argv = _router_argv(args.router_binary, port, p_url, d_url)
        targets.append(Target("router", f"http://127.0.0.1:{port}",
                              stack.enter_context(_quiet_process(argv, env))))  # fmt: skip
        for workers in args.workers:
            port = free_port()
            argv = _pdproxy_argv(port, p_url, d_url, workers)
            name = f"pdproxy-w{workers or os.cpu_count()}"
            pid = stack.enter_context(_quiet_process(argv, env))
            targets.append(Target(name, f"http://127.0.0.1:{port}", pid))
        if args.baseline_tree:
            port = free_port()
            argv = [a for a in _pdproxy_argv(port, p_url, d_url, 1) if a not in ("--workers", "1")]
            base_env = {**env, "PYTHONPATH": args.baseline_tree}
            pid = stack.enter_context(_quiet_process(argv, base_env, cwd=args.baseline_tree))
            targets.append(Target("baseline", f"http://127.0.0.1:{port}", pid))
        scripts = Path(tmp)
        wrk_script = _wrk_script(scripts, 16) if args.wrk else None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for url in (p_url, d_url):
                await _wait_ready(session, url + "/health")
            for target in targets:
                await _wait_ready(session, target.url + "/health")
                for stream in (False, True):  # warm up every path and connection pool
                    call = partial(_post, session, target.url + "/v1/completions",
                                   _body(stream, 16))  # fmt: skip
                    _, _, errors, _ = await _run_cell(call, 8, 0.5, 200)
                    if errors:
                        raise RuntimeError(f"{target.name} failed {errors} warm-up requests")
            for load in loads:
                for _ in range(args.rounds):
                    for target in targets:
                        tally = results.setdefault((load.label, target.name), Tally())
                        await _measure(
                            session, target, load, args, tally=tally, wrk_script=wrk_script
                        )
    return loads, [t.name for t in targets], results


def _report(loads: list[Load], names: list[str], results: Results) -> None:
    print(f"{'load':<14} {'proxy':<11} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'TTFC ms':>8} {'CPU ms/req':>10} {'err':>5}")  # fmt: skip
    for load in loads:
        for name in names:
            t = results[(load.label, name)]
            ttfc = f"{t.ttfc_ms:.2f}" if load.stream else "-"
            print(f"{load.label:<14} {name:<11} {t.rps:>8.0f} {t.p50_ms:>8.2f} "
                  f"{t.p99_ms:>8.2f} {ttfc:>8} {t.cpu_ms:>10.3f} {t.errors:>5}")  # fmt: skip
    print("\npdproxy / vllm-router (same run; req/s >= 1 and CPU <= 1.2 is the goal):")
    for load in loads:
        router = results[(load.label, "router")]
        for name in names[1:]:
            t = results[(load.label, name)]
            line = (f"  {load.label:<14} {name:<11} req/s x{t.rps / router.rps:.2f}  "
                    f"p99 x{t.p99_ms / router.p99_ms:.2f}  "
                    f"CPU/req x{t.cpu_ms / router.cpu_ms:.2f}")  # fmt: skip
            if load.stream:
                line += f"  TTFC p50 x{t.ttfc_ms / router.ttfc_ms:.2f}"
            print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pdproxy vs vllm-router, same backends, one run")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per cell")
    parser.add_argument("--max-requests", type=int, default=20000, help="requests per cell")
    parser.add_argument("--rounds", type=int, default=1, help="alternations per cell")
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 1],
        help="pdproxy --workers values to measure, each its own proxy (0: one per core)",
    )  # fmt: skip
    parser.add_argument("--baseline-tree", metavar="DIR", help="also run this checkout's proxy")
    parser.add_argument("--no-wrk", dest="wrk", action="store_false", help="skip the wrk rows")
    add_router_venv_argument(parser)
    args = parser.parse_args(argv)
    if args.wrk and shutil.which("wrk") is None:
        print("wrk not found (Debian: apt-get install wrk): its rows are skipped", file=sys.stderr)
        args.wrk = False
    args.router_binary = router_binary(args.router_venv.resolve())
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    _report(*asyncio.run(_bench(args)))


if __name__ == "__main__":
    main()

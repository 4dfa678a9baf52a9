"""The proxy's own cost per request, this tree against another checkout, in one run.

``bench_proxy`` measures the proxy process from outside, which on a shared, loaded machine
moves by ±20 % between runs. This one drives the ASGI app directly (no server, no client
process) against instant fake backends in another process, one request at a time, and reports
per request: CPU time of the proxy's process (``time.process_time``, which includes the
upstream client) and Python function calls (counted by ``cProfile`` in a separate pass: a
figure that does not move with machine load). Each tree runs in its own subprocess (its own
working directory and ``PYTHONPATH``), alternating, ``--rounds`` times.

    python -m loadtest.bench_request_path --baseline-tree /path/to/old/checkout [-n 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import orjson

from loadtest.child import child_process
from pdproxy.stack.ports import free_port


async def _drive(p_url: str, d_url: str, n: int, stream: bool) -> dict[str, float]:
    from pdproxy.app import create_app, proxy_state
    from pdproxy.settings import ProxySettings

    settings = ProxySettings.model_validate(
        {
            "backends": [
                {"name": "P", "url": p_url, "role": "producer", "dialect": "nixl"},
                {"name": "D", "url": d_url, "role": "consumer", "dialect": "nixl"},
            ],
            "health": {"enabled": False},
        }
    )
    app = create_app(settings)
    state = proxy_state(app)
    await state.start()
    body = orjson.dumps(
        {"model": "fake-model", "prompt": "the quick brown fox " * 20, "top_p": 0.9,
         "max_tokens": 64, "stream": stream}
    )  # fmt: skip
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip

    async def one() -> None:
        sent = False
        forever = asyncio.Event()

        async def receive() -> MutableMapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await forever.wait()
            return {"type": "http.disconnect"}

        status = 0

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        if status != 200:
            raise RuntimeError(f"proxy answered {status}")

    try:
        for _ in range(200):  # warm up pools and caches
            await one()
        t0 = time.process_time()
        for _ in range(n):
            await one()
        cpu = time.process_time() - t0
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(min(n, 300)):
            await one()
        profile.disable()
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    finally:
        await state.close()
    return {"cpu_us": cpu * 1e6 / n, "calls": calls / min(n, 300)}


def _worker(args: argparse.Namespace) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(_drive(args.p, args.d, args.n, args.stream))
    print(json.dumps(result))


def _measure(tree: str, p_url: str, d_url: str, n: int, stream: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    here = str(Path(__file__).resolve().parents[1])
    # The worker module is this tree's file, run by path so the other tree need not have it.
    script = str(Path(here) / "loadtest" / "bench_request_path.py")
    argv = [sys.executable, script, "--worker", "--p", p_url, "--d", d_url, "-n", str(n)]
    if stream:
        argv.append("--stream")
    out = subprocess.run(
        argv, env=env, cwd=tree, capture_output=True, text=True, timeout=600, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"worker in {tree} failed:\n{out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", help="the other checkout (before)")
    parser.add_argument("-n", type=int, default=2000, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--p", help=argparse.SUPPRESS)
    parser.add_argument("--d", help=argparse.SUPPRESS)
    parser.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    this = str(Path(__file__).resolve().parents[1])
    trees = {"this": this, "baseline": args.baseline_tree or this}
    p_port, d_port = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    backends = [sys.executable, "-m", "loadtest.fake_backend", "--chunks", "64",
                "--listen", f"P={p_port}", "--listen", f"D={d_port}"]  # fmt: skip
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    with child_process(backends):
        time.sleep(1.5)
        for _ in range(args.rounds):
            for stream in (False, True):
                for name in ("baseline", "this"):
                    got = _measure(trees[name], p_url, d_url, args.n, stream)
                    results.setdefault((name, stream), []).append(got)
    print(f"{'kind':<10} {'tree':<9} {'CPU us/req (median)':>20} {'calls/req':>10}")
    for stream in (False, True):
        kind = "stream64" if stream else "nonstream"
        med = {}
        for name in ("baseline", "this"):
            runs = results[(name, stream)]
            med[name] = (
                statistics.median(r["cpu_us"] for r in runs),
                statistics.median(r["calls"] for r in runs),
            )
            print(f"{kind:<10} {name:<9} {med[name][0]:>20.1f} {med[name][1]:>10.0f}")
        cpu_ratio = med["this"][0] / med["baseline"][0]
        call_ratio = med["this"][1] / med["baseline"][1]
        print(f"{kind:<10} this/baseline: CPU x{cpu_ratio:.2f}, calls x{call_ratio:.2f}")


if __name__ == "__main__":
    main()

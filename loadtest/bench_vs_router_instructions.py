"""Instructions per proxied request (valgrind callgrind): a CPU cost that load does not move.

On a shared machine CPU seconds per request drift with other load; instruction counts do not.
Runs ``pdproxy serve --workers 1`` under ``valgrind --tool=callgrind`` with instrumentation off,
warms it up, turns instrumentation on for ``--requests`` requests (non-stream 16 tokens, or a
64-chunk stream, at ``--concurrency``), dumps, and prints instructions and Python allocations
(calls into ``PyObject_Malloc`` and kin: tracemalloc sees only live blocks, not how many were
taken) per request; with
``--baseline-tree DIR`` the same for another checkout, and the ratio; with ``--router`` the same
for vllm-router (PD mode, NIXL, round robin, as in :mod:`loadtest.bench_vs_router`: the whole
process, its Python launcher and its Rust threads), and the ratio. Needs ``valgrind``
(Debian: ``apt-get install valgrind``); the proxy under valgrind is ~50x slower, so keep
``--requests`` small (a few hundred: ~1 minute).

    python -m loadtest.bench_vs_router_instructions [--requests 500] [--stream]
        [--baseline-tree DIR] [--router [--router-venv DIR]] [--by-object]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import aiohttp

from loadtest.bench_proxy import _run_cell, _wait_ready
from loadtest.bench_vs_router import (
    _body,
    _post,
    _router_argv,
    add_router_venv_argument,
    router_binary,
)
from loadtest.bench_vs_router_fronts import ALLOCATORS, callgrind_by_object, callgrind_counts
from loadtest.child import child_process
from pdproxy.stack.ports import free_port


def _pdproxy_argv(tree: Path, port: int, p_url: str, d_url: str) -> list[str]:
    argv = [sys.executable, "-m", "pdproxy.cli", "serve", "--port", str(port), "--workers", "1",
            "--producer", p_url, "--consumer", d_url, "--dialect", "nixl",
            "--router", "round_robin", "--log-level", "warning"]  # fmt: skip
    if "--workers" not in (tree / "pdproxy" / "cli.py").read_text():
        argv = [a for a in argv if a not in ("--workers", "1")]  # a tree from before --workers
    return argv


async def _instructions(
    name: str, argv: list[str], port: int, args: argparse.Namespace, out_dir: Path,
    *, env: dict[str, str], cwd: str | None = None,
) -> tuple[float, float]:  # fmt: skip
    """Instructions and Python allocations (calls into ``PyObject_Malloc`` and kin) per
    request of the server ``argv`` starts on ``port``."""
    out = out_dir / f"callgrind.{port}"
    argv = ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}", *argv]  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = _body(args.stream, 64 if args.stream else 16)
    with child_process(argv, env=env, cwd=cwd) as proc:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _wait_up(session, f"http://127.0.0.1:{port}/health")
            call = partial(_post, session, url, body)
            await _run_cell(call, args.concurrency, 600, 100)  # warm up, not counted
            control = partial(subprocess.run, check=True, capture_output=True)
            control(["callgrind_control", "-i", "on", str(proc.pid)])
            _, _, errors, _ = await _run_cell(call, args.concurrency, 600, args.requests)
            control(["callgrind_control", "-d", str(proc.pid)])
            control(["callgrind_control", "-i", "off", str(proc.pid)])
    if errors:
        raise RuntimeError(f"{errors} requests failed")
    requests: int = args.requests
    dump = Path(f"{out}.1")
    total, calls = callgrind_counts(dump, ALLOCATORS)
    if not total:
        raise RuntimeError(f"no instructions counted in {dump}")
    if args.by_object:
        print(f"  {name}: self instructions per request, by library")
        by_object = callgrind_by_object(dump)
        for lib, ir in sorted(by_object.items(), key=lambda kv: kv[1], reverse=True)[:12]:
            print(f"    {ir / requests:>10,.0f}  {Path(lib).name}")
    return total / requests, sum(calls.values()) / requests


async def _wait_up(session: aiohttp.ClientSession, url: str, timeout_s: float = 300) -> None:
    """Python under valgrind takes tens of seconds to start (more on a loaded machine)."""
    async with asyncio.timeout(timeout_s):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)


async def _bench(
    args: argparse.Namespace, trees: dict[str, Path]
) -> dict[str, tuple[float, float]]:
    p_port, d_port = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    backends = [sys.executable, "-m", "loadtest.fake_backend",
                "--listen", f"P={p_port}", "--listen", f"D={d_port}"]  # fmt: skip
    results: dict[str, tuple[float, float]] = {}
    with child_process(backends), tempfile.TemporaryDirectory() as tmp:
        async with aiohttp.ClientSession() as session:
            for url in (p_url, d_url):
                await _wait_ready(session, url + "/health")
        base_env = {**os.environ, "PDPROXY_HEALTH__ENABLED": "false"}
        for name, tree in trees.items():
            port = free_port()
            results[name] = await _instructions(
                name, _pdproxy_argv(tree, port, p_url, d_url), port, args, Path(tmp),
                env={**base_env, "PYTHONPATH": str(tree)}, cwd=str(tree),
            )  # fmt: skip
        if args.router:
            port = free_port()
            argv = _router_argv(router_binary(args.router_venv.resolve()), port, p_url, d_url)
            results["router"] = await _instructions(
                "router", argv, port, args, Path(tmp), env=base_env
            )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="instructions per proxied request")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="64-chunk streams")
    parser.add_argument("--baseline-tree", metavar="DIR", help="also measure this checkout")
    parser.add_argument(
        "--by-object", action="store_true",
        help="also print each server's instructions per library (ELF object)",
    )  # fmt: skip
    parser.add_argument(
        "--router", action="store_true", help="also measure vllm-router (same load, same fakes)"
    )
    add_router_venv_argument(parser)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found (Debian: apt-get install valgrind)")
    trees = {"pdproxy": Path.cwd()}
    if args.baseline_tree:
        trees["baseline"] = Path(args.baseline_tree).resolve()
    results = asyncio.run(_bench(args, trees))
    kind = "stream64" if args.stream else "nonstream"
    for name, (ir, allocs) in results.items():
        print(f"{kind:<10} {name:<9} {ir:>12,.0f} instructions/request  {allocs:>7.1f} allocations")
    with contextlib.suppress(KeyError):
        ratio = results["pdproxy"][0] / results["baseline"][0]
        print(f"pdproxy / baseline: x{ratio:.3f} instructions")
    with contextlib.suppress(KeyError):
        ratio = results["pdproxy"][0] / results["router"][0]
        print(f"pdproxy / vllm-router: x{ratio:.3f} instructions")


if __name__ == "__main__":
    main()

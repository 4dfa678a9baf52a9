"""``pdproxy serve --workers 2``: two real proxy processes on one port, real fake engines.

Which process holds a client connection is read from ``/proc`` (the socket inodes each child
holds against the established connections to the port), not from anything the proxy says.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.pdproxy.conftest import FakeFactory, eventually

pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-key-for-the-workers-test"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _accepted_connections(port: int) -> dict[int, int]:
    """inode -> 1 for every ESTABLISHED connection whose local port is ``port``."""
    found: dict[int, int] = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            local_port = int(parts[1].split(":")[1], 16)
            if local_port == port and parts[3] == "01":
                found[int(parts[9])] = 1
    return found


def _connections_per_child(supervisor: int, port: int) -> list[int]:
    accepted = _accepted_connections(port)
    return [len(_socket_inodes(c) & accepted.keys()) for c in _children(supervisor)]


def _sibling_socket_dirs(pid: int) -> set[Path]:
    inodes = _socket_inodes(pid)
    dirs = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and int(parts[6]) in inodes and "pdproxy-siblings-" in parts[7]:
                dirs.add(Path(parts[7]).parent)
    return dirs


def _metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or labels.items() <= sample.labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name} {labels} not exposed")


@asynccontextmanager
async def _serve(
    p_url: str, d_url: str, *extra: str
) -> AsyncIterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdproxy.cli", "serve", "--port", str(port), "--workers", "2",
         "--producer", p_url, "--consumer", d_url, "--log-level", "warning", *extra],
        env={**os.environ, "PDPROXY_HEALTH__ENABLED": "false", "PDPROXY_ADMIN_KEY": ADMIN_KEY},
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for _ in range(300):
                try:
                    if (await c.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
        await eventually(lambda: len(_children(proc.pid)) == 2, timeout=10)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


async def _on_fresh_connections(
    port: int, n: int, method: str, path: str, **kw: object
) -> list[httpx.Response]:
    """``n`` requests, each on a connection of its own, all open at once."""
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) for _ in range(n)]
    try:
        return list(await asyncio.gather(*(c.request(method, path, **kw) for c in clients)))  # type: ignore[arg-type]
    finally:
        for c in clients:
            await c.aclose()


async def test_two_processes_share_the_port_and_both_answer(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D")
    async with _serve(p.url, d.url) as (proc, port):
        clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") for _ in range(16)]
        try:
            answers = await asyncio.gather(
                *(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) for c in clients)
            )
            assert [r.status_code for r in answers] == [200] * 16
            per_child = _connections_per_child(proc.pid, port)
            # 16 connections hashed over two sockets: each process holds some (all in one
            # would have probability 2**-15).
            assert len(per_child) == 2 and all(n > 0 for n in per_child), per_child
            assert sum(per_child) == 16
        finally:
            for c in clients:
                await c.aclose()


async def test_sigterm_drains_in_flight_requests_of_both_processes(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D", first_chunk_delay_s=1.5)
    async with _serve(p.url, d.url) as (proc, port):
        clients = [
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) for _ in range(16)
        ]
        slow: list[asyncio.Task[httpx.Response]] = []
        try:
            slow += [
                asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
                for c in clients
            ]
            await eventually(lambda: len(d.consumer_legs()) == 16, timeout=10)
            per_child = _connections_per_child(proc.pid, port)
            assert all(n > 0 for n in per_child), per_child  # both hold in-flight requests
            proc.send_signal(signal.SIGTERM)
            answers = await asyncio.gather(*slow)
            assert [r.status_code for r in answers] == [200] * 16
            assert all(r.json()["object"] == "text_completion" for r in answers)
            assert d.aborts == 0
        finally:
            for task in slow:
                task.cancel()
            for c in clients:
                await c.aclose()
        assert await asyncio.to_thread(proc.wait, 15) == 0


async def test_metrics_add_up_over_the_processes(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D")
    async with _serve(p.url, d.url) as (_, port):
        answers = await _on_fresh_connections(
            port, 24, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2}
        )
        assert [r.status_code for r in answers] == [200] * 24
        # Each scrape on its own connection, so both processes answer some of them; every
        # one of them sees the whole proxy.
        for scrape in await _on_fresh_connections(port, 8, "GET", "/metrics"):
            text = scrape.text
            labels = {"route": "completions", "status": "200"}
            assert _metric(text, "pdproxy_requests_total", labels) == 24
            assert _metric(text, "pdproxy_leg_latency_seconds_count", {"leg": "producer"}) == 24
            assert _metric(text, "pdproxy_proxy_processes") == 2
            assert _metric(text, "pdproxy_proxy_processes_unreachable") == 0
            assert _metric(text, "pdproxy_backend_healthy", {"backend": "consumer-0"}) == 1


async def test_an_admin_change_reaches_every_process(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D")
    async with _serve(p.url, d.url) as (_, port):
        auth = {"authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            r = await c.post("/admin/backends/consumer-0/drain", headers=auth)
            assert r.status_code == 200
        for listing in await _on_fresh_connections(port, 8, "GET", "/admin/backends", headers=auth):
            states = {b["name"]: b["draining"] for b in listing.json()["backends"]}
            assert states["consumer-0"] is True


async def test_the_sibling_channel_is_private_and_not_reachable_over_tcp(fake: FakeFactory) -> None:
    """The attacker: a TCP client trying to get one process's own view, or to change one
    process alone; and another local user trying the sibling sockets."""
    p, d = await fake("P"), await fake("D")
    async with _serve(p.url, d.url) as (proc, port):
        dirs = {dir_ for child in _children(proc.pid) for dir_ in _sibling_socket_dirs(child)}
        assert len(dirs) == 1
        mode = (dirs.pop()).stat().st_mode
        assert stat.S_IMODE(mode) == 0o700  # only the proxy's user can connect
        # No header or address makes a TCP request "from a sibling": /metrics always adds up.
        spoof = {"host": "sibling", "x-forwarded-for": "127.0.0.1"}
        for scrape in await _on_fresh_connections(port, 6, "GET", "/metrics", headers=spoof):
            assert _metric(scrape.text, "pdproxy_proxy_processes") == 2
        # An admin change without the key is refused and reaches no process.
        r = await _on_fresh_connections(port, 1, "POST", "/admin/backends/consumer-0/drain")
        assert r[0].status_code == 401
        auth = {"authorization": f"Bearer {ADMIN_KEY}"}
        for listing in await _on_fresh_connections(port, 6, "GET", "/admin/backends", headers=auth):
            assert all(b["draining"] is False for b in listing.json()["backends"])


async def test_a_supervisor_that_is_pid_1_starts_its_workers(fake: FakeFactory) -> None:
    """In a container the supervisor is pid 1: its children must not take that for "my parent
    died" (they did, and the compose stack's proxy never started)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a pid namespace needs root and util-linux's unshare")
    p, d = await fake("P"), await fake("D")
    port = free_port()
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "pdproxy.cli",
         "serve", "--port", str(port), "--workers", "2", "--producer", p.url, "--consumer", d.url,
         "--log-level", "warning"],
        env={**os.environ, "PDPROXY_HEALTH__ENABLED": "false"},
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            ready = False
            for _ in range(600):  # bounded: 60 s
                try:
                    ready = (await c.get("/ready")).status_code == 200
                except httpx.TransportError:
                    ready = False
                if ready or proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            assert ready, f"not ready; supervisor exit status {proc.poll()}"
            metrics = await c.get("/metrics")
        assert _metric(metrics.text, "pdproxy_proxy_processes") == 2
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)

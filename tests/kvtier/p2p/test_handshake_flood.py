"""A handshake flood against a real producer process keeps its memory bounded.

Issue 15 measured it before the fix: 200 peers sending 4 bytes each (a length prefix announcing
a 4 MiB frame) took a producer from 37 to 839 MiB RSS, because each connection allocated the
announced frame before authentication. Here 200 peers, each from its own loopback address (so
per-address limits alone do not hide the cost), half announcing a 4 MiB frame and half silent,
all held open; the producer's RSS is sampled throughout. The promise checked is generous on
purpose (a shared, noisy machine): growth under 64 MiB, against 800 MiB before. A legitimate
consumer is served afterwards (the control).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import pytest

from kvtier.p2p.frames import LENGTH_PREFIX

from .conftest import make_keys, make_pair

pytestmark = pytest.mark.slow

PEERS = 200
RSS_GROWTH_LIMIT = 64 << 20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def open_flood(port: int) -> list[socket.socket]:
    socks: list[socket.socket] = []
    for i in range(PEERS):
        sock = socket.socket()
        try:
            sock.bind((f"127.0.{1 + i // 250}.{1 + i % 250}", 0))
            sock.settimeout(3)
            sock.connect(("127.0.0.1", port))
            if i % 2 == 0:
                sock.sendall(LENGTH_PREFIX.pack((4 << 20) - 1))
        except OSError:
            sock.close()
            continue  # refused on accept under the caps: that is the point
        socks.append(sock)
    return socks


async def test_handshake_flood_keeps_producer_rss_bounded() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.kvtier.p2p.producer_proc",
        "flood",
        "4",
        "0",
        stdout=asyncio.subprocess.PIPE,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    pair = await make_pair()
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        await asyncio.sleep(0.2)
        before = rss_bytes(proc.pid)
        socks = await asyncio.to_thread(open_flood, port)
        assert len(socks) >= PEERS // 2, len(socks)  # the flood did reach the server
        peak = before
        deadline = time.monotonic() + 1.5  # within the producer's 2 s handshake timeout
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes(proc.pid))
            await asyncio.sleep(0.05)
        growth = peak - before
        assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / (1 << 20):.1f} MiB"
        for sock in socks:
            sock.close()
        socks = []
        result = await pair.client.fetch("127.0.0.1", port, "flood", make_keys(4))
        assert result.complete, result
    finally:
        for sock in socks:
            sock.close()
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await pair.client.close()
        await pair.server.stop()

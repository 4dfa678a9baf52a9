"""Admin bodies without the admin key against a real ``pdproxy serve --workers 2`` (issue 30
finding 2).

With several processes an admin change is replayed to every sibling, so its body is read whole
first. Before the fix it was read (up to ``max_body_bytes``, with no deadline) before the admin
key was checked, and even with the admin API off: 48 such connections held +196 MiB. One process
alone answered 401 at once; now N processes do the same, before reading a byte of the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from loadtest.fake_backend import FakeBackend

from .attackers import group_rss
from .procs import ManagedProcess, ProcessGroup
from .proxy_client import backend
from .record import Tally

pytestmark = pytest.mark.slow

_MiB = 2**20
_ADMIN_KEY = "admin-key-0123456789abcdef0123456789"


async def _unkeyed_admin_body(port: int, declared: int, sent: int) -> tuple[float, bytes]:
    """POST /admin/backends declaring ``declared`` body bytes, sending up to ``sent`` of them
    (with a wrong key); returns how long until the proxy answered, and the answer's start."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(
        b"POST /admin/backends HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer not-the-admin-key\r\n"
        b'Content-Length: %d\r\n\r\n{"name": "' % declared
    )
    got = b""
    piece = b"x" * (64 * 1024)
    try:
        written = 0
        while time.monotonic() - started < 10 and not got:
            if written < sent:
                writer.write(piece)
                written += len(piece)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(writer.drain(), 0.2)
            with contextlib.suppress(TimeoutError):
                got = await asyncio.wait_for(reader.read(64), 0.05 if written < sent else 0.5)
                if not got:
                    break
    except OSError:
        pass
    finally:
        writer.transport.abort()
    return time.monotonic() - started, got


@pytest.mark.parametrize("admin", ["keyed", "off"])
async def test_admin_bodies_are_refused_before_they_are_read(
    procs: ProcessGroup, tally: Tally, admin: str
) -> None:
    d = FakeBackend("D")
    async with d:
        config = {
            "backends": [backend("D", d.url, "consumer", "nixl")],
            "health": {"enabled": False},
            "workers": 2,
        }
        if admin == "keyed":
            config["admin_key"] = _ADMIN_KEY
        proxy: ManagedProcess = procs.proxy("proxy", config)
        port = int(proxy.url.rsplit(":", 1)[1])
        base = group_rss(proxy)
        peak = base
        tasks = [
            asyncio.create_task(_unkeyed_admin_body(port, 4 * _MiB - 4096, 3 * _MiB))
            for _ in range(48)
        ]
        while not all(t.done() for t in tasks):
            peak = max(peak, group_rss(proxy))
            await asyncio.sleep(0.1)
        results = [t.result() for t in tasks]
    expected = b"HTTP/1.1 401" if admin == "keyed" else b"HTTP/1.1 404"
    for elapsed, got in results:
        if got.startswith(expected) and elapsed < 5.0:
            tally.ok()
        else:
            tally.fail(f"unkeyed admin body: {got[:20]!r} after {elapsed:.1f} s")
    tally.notes.append(
        f"48 unkeyed 4 MiB admin bodies (admin API {admin}): "
        f"{tally.succeeded}/{tally.sent} refused, slowest after "
        f"{max(e for e, _ in results):.2f} s; RSS {base / _MiB:.0f} -> {peak / _MiB:.0f} MiB"
    )
    print(tally.notes[-1])
    assert tally.failed == 0, tally.notes
    assert peak - base < 64 * _MiB, tally.notes

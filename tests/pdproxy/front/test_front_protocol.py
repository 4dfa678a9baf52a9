"""A client leaving is noticed through the server's disconnect hook (no watcher task).

Real ``pdproxy serve`` (one process, so its own HTTP protocol), real fake engines, raw client
sockets that hang up: the proxy must abort the upstream leg it was waiting on, in the producer
phase, the consumer phase and mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from pdproxy.front.cancel import CLIENT_DISCONNECT, RequestCanceller
from pdproxy.front.protocol import DisconnectHook
from tests.conftest import free_port
from tests.pdproxy.conftest import FakeFactory, eventually

_BODY = b'{"model":"m","prompt":"x","max_tokens":64%s}'


@asynccontextmanager
async def _serve(p_url: str, d_url: str) -> AsyncIterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdproxy.cli", "serve", "--port", str(port), "--workers", "1",
         "--producer", p_url, "--consumer", d_url, "--log-level", "warning"],
        env={**os.environ, "PDPROXY_HEALTH__ENABLED": "false"},
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for _ in range(300):
                try:
                    if (await c.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _send(port: int, stream: bool) -> socket.socket:
    body = _BODY % (b',"stream":true' if stream else b"")
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["producer", "consumer", "stream"])
async def test_a_client_hanging_up_aborts_the_leg_in_flight(fake: FakeFactory, phase: str) -> None:
    p = await fake("P", hang=phase == "producer")
    d = await fake("D", hang=phase == "consumer", chunk_delay_s=0.2 if phase == "stream" else 0)
    waiting_on = p if phase == "producer" else d
    async with _serve(p.url, d.url) as port:
        sock = _send(port, stream=phase == "stream")
        try:
            await eventually(lambda: len(waiting_on.received) == 1, timeout=10)
            if phase == "stream":
                first = await asyncio.to_thread(sock.recv, 65536)
                assert first.startswith(b"HTTP/1.1 200")
        finally:
            sock.close()
        await eventually(lambda: waiting_on.aborts == 1, timeout=10)


async def test_a_client_gone_before_the_canceller_existed_is_still_noticed() -> None:
    hook = DisconnectHook()
    hook.lost = True
    canceller = RequestCanceller(lambda: asyncio.sleep(0), hook)  # type: ignore[arg-type,return-value]
    assert canceller.reason == CLIENT_DISCONNECT
    with pytest.raises(asyncio.CancelledError), canceller.armed():
        pass
    canceller.close()
    assert hook.callback is None


async def test_the_hook_cancels_an_armed_section_at_once() -> None:
    hook = DisconnectHook()
    canceller = RequestCanceller(lambda: asyncio.sleep(0), hook)  # type: ignore[arg-type,return-value]
    assert hook.callback is not None

    async def leg() -> None:
        with canceller.armed():
            await asyncio.sleep(30)

    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().call_soon(hook.callback)
    with pytest.raises(asyncio.CancelledError) as exc:
        await leg()
    assert canceller.owns(exc.value)
    canceller.close()

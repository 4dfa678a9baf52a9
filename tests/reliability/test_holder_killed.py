"""Symmetric pull: the holder is SIGKILLed while another worker pulls a prefix from it.

The puller's P2P connection (``remote_kv_source``) runs through a relay that kills the holder
process once part of the transfer has flowed. The puller must install the blocks that arrived,
recompute from the first gap, and answer exactly what a single node answers (tiny model: real
attention over the KV), within its fetch deadline, with no supply, pinned page or task left.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from .faults import TcpRelay
from .legs import completion, counter, metrics
from .procs import ProcessGroup
from .record import Tally
from .resources import Tolerance, sample_worker, settle

pytestmark = pytest.mark.slow

_PROMPT = "The holder dies halfway; the puller must still answer exactly. " * 14


async def test_holder_killed_mid_pull(procs: ProcessGroup, tally: Tally) -> None:
    holder = procs.worker("killed-holder", role="both", model="tiny", wait=False)
    puller = procs.worker("puller", role="consumer", model="tiny", wait=False)
    holder.wait_healthy()
    puller.wait_healthy()
    body = {"prompt": _PROMPT, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=120) as client:
        solo = await completion(client, holder.url, body)  # warms the holder
        # Salted: the same work (torch allocates its buffers) with no block in common.
        await completion(client, puller.url, {**body, "cache_salt": "warm-up"})
        base = sample_worker(puller.url, puller.pid)  # after warm-up (torch allocates)
        async with TcpRelay(holder.p2p_port) as relay:
            killed: list[int] = []

            def kill_once(total: int) -> None:
                # A page of tiny is 16 KiB: kill after a few pages, long before the end.
                if total >= 64 * 1024 and not killed:
                    killed.append(total)
                    holder.signal(signal.SIGKILL)
                    relay.cut()

            relay.on_upstream_bytes = kill_once
            source = {"remote_host": "127.0.0.1", "remote_port": relay.port,
                      "remote_engine_id": "killed-holder"}  # fmt: skip
            started = time.monotonic()
            answer = await completion(client, puller.url, body, {"remote_kv_source": source})
            elapsed = time.monotonic() - started
        assert killed, "the pull finished before the holder could be killed"
        holder.kill()  # reap
        m = await metrics(client, puller.url)
        pulled = counter(m, "pull_blocks")
        assert counter(m, "pull_failures") == 1
        assert pulled > 0, "nothing arrived before the kill: not a mid-pull failure"
        assert answer["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        assert elapsed < 5 + 60  # the fetch deadline (5 s) plus compute on a busy machine
        assert m.get("kvtier_worker_p2p_supplies", 0) == 0
        tally.ok(fallback=True)
        tally.notes.append(f"killed after {killed[0]} B; {pulled:.0f} blocks pulled")
        _, leaks = settle(puller.url, puller.pid, base, Tolerance())
        tally.leaks.extend(leaks)
        assert not leaks, leaks

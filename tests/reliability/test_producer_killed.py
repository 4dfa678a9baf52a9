"""Scenario 1: the producer is SIGKILLed while the consumer is fetching its KV.

The consumer's P2P connection runs through a relay that kills the producer process once part of
the transfer has flowed. The consumer must install the blocks that arrived, recompute from the
first gap, and answer exactly what a single node answers (tiny model: real attention over the
KV, so wrong or missing KV shows in the tokens).
"""

from __future__ import annotations

import signal

import httpx
import pytest

from .faults import TcpRelay
from .legs import completion, counter, metrics, producer_leg
from .procs import ProcessGroup
from .record import Tally
from .resources import Tolerance, sample_worker, settle

pytestmark = pytest.mark.slow

_PROMPT = "The producer dies halfway; the consumer must still answer exactly. " * 14


async def test_producer_killed_mid_transfer(procs: ProcessGroup, tally: Tally) -> None:
    producer = procs.worker("killed-producer", role="producer", model="tiny", wait=False)
    consumer = procs.worker("survivor", role="both", model="tiny", wait=False)
    producer.wait_healthy()
    consumer.wait_healthy()
    body = {"prompt": _PROMPT, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=120) as client:
        # Single-node reference on the consumer, salted so that it shares no cached block
        # (tiny's KV depends on the tokens only, so the salt does not change the answer).
        solo = await completion(client, consumer.url, {**body, "cache_salt": "single-node"})
        base = sample_worker(consumer.url, consumer.pid)  # after warm-up (torch allocates)
        supply = await producer_leg(client, producer.url, body)
        assert supply.num_blocks >= 20

        async with TcpRelay(producer.p2p_port) as relay:
            killed: list[int] = []

            def kill_once(total: int) -> None:
                # A page of tiny is 16 KiB: kill after a few pages, long before the end.
                if total >= 64 * 1024 and not killed:
                    killed.append(total)
                    producer.signal(signal.SIGKILL)
                    relay.cut()

            relay.on_upstream_bytes = kill_once
            answer = await completion(
                client, consumer.url, body, supply.consumer_params(port=relay.port)
            )
        assert killed, "the transfer finished before the producer could be killed"
        producer.kill()  # reap
        m = await metrics(client, consumer.url)
        fetched = counter(m, "p2p_blocks_fetched")
        assert counter(m, "p2p_fetch_failures") == 1
        assert fetched > 0, "nothing arrived before the kill: not a mid-transfer failure"
        assert counter(m, "recomputed_tokens") > 0
        assert answer["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        tally.ok(fallback=True)
        tally.notes.append(
            f"killed after {killed[0]} B; {fetched:.0f} blocks fetched, "
            f"{counter(m, 'recomputed_tokens'):.0f} tokens recomputed"
        )
        _, leaks = settle(consumer.url, consumer.pid, base, Tolerance())
        tally.leaks.extend(leaks)
        assert not leaks, leaks

"""A consumer whose fetch falls short must not leave the producer holding the supply.

The consumer's P2P traffic runs through a relay that delays every chunk past the consumer's
fetch deadline, so its fetch stops early and drops the session without a ``done``. It
recomputes the rest (the answer still equals the producer's single-node answer), and the
producer's supplies must be back at zero long before the lease (20 s) would free them.
"""

from __future__ import annotations

import httpx
import pytest

from .faults import TcpRelay
from .legs import completion, counter, metrics, producer_leg
from .procs import ProcessGroup
from .proxy_client import wait_for
from .record import Tally
from .resources import ZERO_GAUGES

pytestmark = pytest.mark.slow

_PROMPT = "Far more blocks than the consumer has host pages for. " * 20


async def test_short_fetch_releases_supply(procs: ProcessGroup, tally: Tally) -> None:
    producer = procs.worker("p", role="producer", wait=False)
    consumer = procs.worker("d", role="consumer", args=["--fetch-timeout-s", "0.5"], wait=False)
    producer.wait_healthy()
    consumer.wait_healthy()
    body = {"prompt": _PROMPT, "max_tokens": 6, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as client:
        supply = await producer_leg(client, producer.url, body)
        async with TcpRelay(producer.p2p_port) as relay:
            relay.delay_s = 0.2
            answer = await completion(
                client, consumer.url, body, supply.consumer_params(port=relay.port)
            )
            relay.delay_s = 0.0
            m = await metrics(client, consumer.url)
            assert counter(m, "p2p_fetch_failures") == 1, "the fetch did not fall short"
            reference = await completion(client, producer.url, body)
            assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
            tally.ok(fallback=True)
            released_in = await wait_for(
                client, producer, lambda g: not any(g.get(n, 0.0) for n in ZERO_GAUGES), 5.0
            )
        if released_in is None:
            tally.leaks.append("producer still holds the supply 5 s after a short fetch")
        else:
            tally.notes.append(f"supply released {released_in:.2f} s after the answer")
    assert not tally.leaks, tally.leaks

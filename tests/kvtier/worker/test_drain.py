"""Shutdown drain in process: no new requests, in-flight ones finish or are aborted in bound."""

from __future__ import annotations

import asyncio
import time

from .conftest import running_worker, small_settings


async def test_drain_refuses_new_requests_and_lets_short_ones_finish() -> None:
    settings = small_settings(model="sim", sim_decode_ms_per_step=5.0, shutdown_timeout_s=10.0)
    async with running_worker(settings) as rw:
        body = {"prompt": "finish me", "max_tokens": 20}
        in_flight = asyncio.create_task(rw.client.post("/v1/completions", json=body))
        deadline = time.monotonic() + 5
        while rw.worker.engine.num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            await asyncio.sleep(0.005)
        rw.worker.begin_shutdown()
        refused = await rw.client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        finished = await in_flight
        assert finished.status_code == 200
        assert finished.json()["usage"]["completion_tokens"] == 20


async def test_drain_aborts_what_outlives_the_bound() -> None:
    settings = small_settings(model="sim", sim_decode_ms_per_step=20.0, shutdown_timeout_s=0.2)
    async with running_worker(settings) as rw:
        body = {"prompt": "too long", "max_tokens": 500}  # ~10 s of decoding
        in_flight = asyncio.create_task(rw.client.post("/v1/completions", json=body))
        deadline = time.monotonic() + 5
        while rw.worker.engine.num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            await asyncio.sleep(0.005)
        started = time.monotonic()
        rw.worker.begin_shutdown()
        aborted = await asyncio.wait_for(in_flight, 5)
        assert time.monotonic() - started < 3
        assert aborted.status_code == 503
        assert rw.worker.engine.num_running == 0 and rw.worker.engine.num_waiting == 0

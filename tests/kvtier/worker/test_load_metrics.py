"""The reference worker's load series, read by the proxy's engine-load parser: the worker and
the router agree on names and meaning (waiting, running, KV usage)."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.routing.kv.engine_metrics_text import EngineSample, parse_engine_metrics

from .conftest import running_worker, small_settings


async def test_router_reads_the_workers_queue() -> None:
    settings = small_settings(model="sim", max_running=1, sim_decode_ms_per_step=20.0)
    async with running_worker(settings) as w:
        idle = parse_engine_metrics((await w.client.get("/metrics")).content)
        assert idle is not None and (idle.waiting, idle.running) == (0, 0)
        body = {"prompt": "a queued request " * 4, "max_tokens": 40}
        legs = [asyncio.create_task(w.client.post("/v1/completions", json=body)) for _ in range(3)]
        seen: EngineSample | None = None
        for _ in range(500):
            seen = parse_engine_metrics((await w.client.get("/metrics")).content)
            if seen is not None and (seen.waiting, seen.running) == (2, 1):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"never saw 1 running + 2 waiting (last: {seen})")
        assert seen.kv_usage is not None and 0.0 < seen.kv_usage <= 1.0
        for leg in legs:
            assert (await leg).status_code == 200

"""The worker's TTFT / ITL / TPOT histograms on /metrics, after real requests (in process)."""

from __future__ import annotations

import re

from .conftest import running_worker, small_settings

PROMPT = "Tell me a story about a block of sixteen tokens. " * 3


def _count(text: str, name: str) -> float:
    m = re.search(rf"^kvtier_worker_{name}_count (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


async def test_each_token_is_timed_once() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        for _ in range(3):
            r = await w.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
            assert r.status_code == 200
        one = await w.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert one.status_code == 200
        text = (await w.client.get("/metrics")).text
    assert _count(text, "time_to_first_token_seconds") == 4  # every request's first token
    assert _count(text, "inter_token_latency_seconds") == 3 * 4  # gaps between 5 tokens
    assert _count(text, "time_per_output_token_seconds") == 3  # not the one-token request
    inf = re.search(r'^kvtier_worker_time_to_first_token_seconds_bucket\{le="\+Inf"\} (\S+)$',
                    text, re.M)  # fmt: skip
    assert inf is not None and float(inf.group(1)) == 4
    assert re.search(r"^kvtier_worker_time_to_first_token_seconds_sum [0-9.e-]+$", text, re.M)

"""A consumer's refusal never tells the client where the KV lives (issue 30, "also seen").

An engine that refuses a consumer leg may quote what it was told: the producer's KV address
from ``kv_transfer_params``, its own address. The proxy relays a 4xx body (it is about the
client's request), so it must take those internal addresses out first.
"""

from __future__ import annotations

import asyncio

import orjson

from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings
from tests.pdproxy.raw_upstream import answer, raw_server


async def test_a_consumers_refusal_quoting_the_kv_address_is_redacted(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    producer = await fake("P")  # NIXL answers name remote_host 127.0.0.1, remote_port 5600
    quoted: list[str] = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await srv.read_request(reader)
            kvp = orjson.loads(body)["kv_transfer_params"]
            peer = f"{kvp['remote_host']}:{kvp['remote_port']}"
            quoted.append(peer)
            message = f"NIXL handshake with {peer} failed (engine {producer.host}:{producer.port})"
            error = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
            json = b"content-type: application/json\r\n"
            writer.write(answer(orjson.dumps(error), json, status=b"400 Bad Request"))
            await writer.drain()

    async with raw_server(refuse) as srv:
        entry = {"name": "D", "url": srv.url, "role": "consumer", "dialect": "nixl"}
        px = await proxy(quick_settings([backend_entry(producer, "producer"), entry]))
        async with px.client() as client:
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert quoted == ["127.0.0.1:5600"]
    assert r.status_code == 400
    message = r.json()["error"]["message"]  # still the engine's JSON, still readable
    assert "NIXL handshake with [internal] failed" in message, message
    assert "127.0.0.1" not in r.text and str(producer.port) not in r.text, r.text

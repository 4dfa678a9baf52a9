"""The two PD legs over HTTP against worker processes (what the proxy does, DESIGN §3)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from .resources import parse_metrics


@dataclass(frozen=True, slots=True)
class Supply:
    """A producer leg's answer: where and under which id its KV can be fetched."""

    kv_request_id: str
    host: str
    port: int
    num_blocks: int
    engine_id: str | None = None
    """The producer's node id (``remote_engine_id`` of its answer)."""

    def consumer_params(
        self,
        *,
        port: int | None = None,
        kv_request_id: str | None = None,
        engine_id: str | None = None,
    ) -> Any:
        """``remote_prefiller`` as the proxy builds it; ``engine_id`` adds ``remote_engine_id``
        (the producer the consumer must find at that address)."""
        prefiller: dict[str, Any] = {
            "kv_request_id": kv_request_id or self.kv_request_id,
            "remote_host": self.host,
            "remote_port": port or self.port,
        }
        if engine_id is not None:
            prefiller["remote_engine_id"] = engine_id
        return {"remote_prefiller": prefiller}


async def producer_leg(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], kv_request_id: str = ""
) -> Supply:
    kv_request_id = kv_request_id or uuid.uuid4().hex
    leg = {**body, "max_tokens": 1, "stream": False}
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = {"remote_decoder": {"kv_request_id": kv_request_id}}
    resp = await client.post(f"{url}/v1/completions", json=leg)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["kv_transfer_params"]
    return Supply(
        answer["kv_request_id"],
        answer["remote_host"],
        answer["remote_port"],
        answer["num_blocks"],
        answer.get("remote_engine_id"),
    )


async def completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], params: Any = None
) -> dict[str, Any]:
    payload = dict(body) if params is None else {**body, "kv_transfer_params": params}
    resp = await client.post(f"{url}/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


async def metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    return parse_metrics((await client.get(f"{url}/metrics")).text)


def counter(values: dict[str, float], name: str) -> float:
    return values.get(f"kvtier_worker_{name}_total", values.get(f"kvtier_worker_{name}", 0.0))

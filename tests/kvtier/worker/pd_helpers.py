"""Helpers of the PD tests: run a request as producer leg + consumer leg, in either dialect."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvtier.worker.p2p_connector import P2PConnector

from .conftest import RunningWorker, running_worker, small_settings

NIXL_PRODUCER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class PDResult:
    producer: dict[str, Any]
    consumer: dict[str, Any]

    @property
    def token_ids(self) -> list[int]:
        ids: list[int] = self.consumer["choices"][0]["token_ids"]
        return ids


async def pd_request(
    producer: RunningWorker,
    consumer: RunningWorker,
    body: dict[str, Any],
    dialect: str,
    path: str = "/v1/completions",
) -> PDResult:
    """The proxy's two legs, as DESIGN §3 describes them."""
    leg = {**body, "max_tokens": 1, "stream": False}
    leg.pop("stream_options", None)
    if dialect == "p2p":
        kv_request_id = uuid.uuid4().hex
        leg["kv_transfer_params"] = {"remote_decoder": {"kv_request_id": kv_request_id}}
    else:
        leg["kv_transfer_params"] = dict(NIXL_PRODUCER_PARAMS)
    resp = await producer.client.post(path, json=leg, headers={"X-Request-Id": uuid.uuid4().hex})
    assert resp.status_code == 200, resp.text
    produced = resp.json()
    answer = produced["kv_transfer_params"]
    assert answer is not None
    if dialect == "p2p":
        assert set(answer) == {
            "remote_host",
            "remote_port",
            "kv_request_id",
            "num_blocks",
            "remote_engine_id",
        }
        consumer_params: dict[str, Any] = {
            "remote_prefiller": {
                "kv_request_id": answer["kv_request_id"],
                "remote_host": answer["remote_host"],
                "remote_port": answer["remote_port"],
                "remote_engine_id": answer["remote_engine_id"],
            }
        }
    else:
        assert answer["do_remote_prefill"] is True and answer["tp_size"] == 1
        consumer_params = answer  # forwarded verbatim
    resp = await consumer.client.post(path, json={**body, "kv_transfer_params": consumer_params})
    assert resp.status_code == 200, resp.text
    return PDResult(produced, resp.json())


def connector(w: RunningWorker) -> P2PConnector:
    conn = w.worker.connector
    assert isinstance(conn, P2PConnector)
    return conn


def assert_released(*workers: RunningWorker) -> None:
    """Every supply released, every device and host page back at zero references."""
    for w in workers:
        for pool in w.worker.engine.kv.pools:
            assert pool.refcounts() == [0] * pool.num_pages
        assert w.worker.engine.num_running == 0 and w.worker.engine.num_waiting == 0
        conn = connector(w)
        stats = conn.registry.stats()
        assert (stats.requests, stats.held_pages, stats.sending) == (0, 0, 0)
        assert conn.pool.stats().referenced == 0 and conn.pool.stats().writing == 0
        assert conn.manager.stats().requests == 0


@contextlib.asynccontextmanager
async def workers(model: str, *roles: str, **overrides: Any) -> AsyncIterator[list[RunningWorker]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                running_worker(small_settings(model=model, role=role, **overrides))
            )
            for role in roles
        ]

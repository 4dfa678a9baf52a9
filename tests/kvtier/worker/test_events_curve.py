"""A worker configured with CURVE keys publishes its KV events to admitted subscribers only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.events import BlockStored, EventBatch, EventSubscriber
from kvtier.events.curve import load_client, write_certificate
from kvtier.worker.settings import WorkerSettings
from tests.kvtier.events.conftest import write_curve_files

from .conftest import running_worker, small_settings

PROMPT = "Confidential: the quarterly numbers are not public yet, do not repeat them. " * 2


class Tap:
    def __init__(self) -> None:
        self.token_ids: list[int] = []

    async def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.token_ids.extend(event.token_ids)


async def test_only_the_admitted_subscriber_reads_the_prompt(tmp_path: Path) -> None:
    files = write_curve_files(tmp_path / "curve")
    settings = small_settings(
        model="sim",
        events_endpoint="tcp://127.0.0.1:*",
        events_replay_endpoint="tcp://127.0.0.1:*",
        events_curve_secret_key_file=files.server_secret,
        events_curve_clients_dir=files.clients_dir,
    )
    async with running_worker(settings) as w:
        pub = w.worker.events.publisher
        assert pub is not None and pub.replay_endpoint is not None
        admitted, spy = Tap(), Tap()
        async with (
            EventSubscriber(
                pub.endpoint, pub.replay_endpoint, on_batch=admitted.on_batch, curve=files.client()
            ),
            EventSubscriber(
                pub.endpoint, pub.replay_endpoint, on_batch=spy.on_batch, replay_timeout_s=0.3
            ) as plain,
        ):
            prompt_ids = list(PROMPT.encode())
            async with asyncio.timeout(15):
                while admitted.token_ids[:64] != prompt_ids[:64]:
                    resp = await w.client.post(
                        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}
                    )
                    assert resp.status_code == 200
                    await asyncio.sleep(0.1)
            assert spy.token_ids == [] and plain.stats.received == 0
        # A keyless client fails before the key check; an unadmitted key pair is refused by it
        # and counted.
        _, stranger_secret = write_certificate(tmp_path / "stranger", "stranger")
        stranger = Tap()
        async with EventSubscriber(
            pub.endpoint,
            on_batch=stranger.on_batch,
            curve=load_client(stranger_secret, files.server_public),
        ):
            async with asyncio.timeout(10):
                while pub.refused_clients == 0:
                    await asyncio.sleep(0.05)
        assert stranger.token_ids == []
        metrics = (await w.client.get("/metrics")).text
        assert "kvtier_worker_kv_events_refused_clients_total" in metrics
        assert "kvtier_worker_kv_events_refused_clients_total 0.0" not in metrics


def test_curve_files_come_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        WorkerSettings(events_curve_secret_key_file=tmp_path / "w.key_secret")

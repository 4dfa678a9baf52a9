"""Fixtures of the reference-worker tests: small settings and in-process workers over ASGI."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import Worker


def small_settings(**overrides: Any) -> WorkerSettings:
    """Settings small enough for fast tests on busy CPUs (env vars are not consulted)."""
    base: dict[str, Any] = {
        "model": "tiny",
        "num_pages": 192,
        "host_pages": 256,
        "max_model_len": 1024,
        "fetch_timeout_s": 5.0,
        "supply_lease_s": 30.0,
    }
    base.update(overrides)
    return WorkerSettings(**base)


@dataclass
class RunningWorker:
    app: FastAPI
    client: httpx.AsyncClient

    @property
    def worker(self) -> Worker:
        worker: Worker = self.app.state.worker
        return worker


@contextlib.asynccontextmanager
async def running_worker(settings: WorkerSettings) -> AsyncIterator[RunningWorker]:
    """A worker app with its lifespan running, and an httpx client bound to it in process."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            yield RunningWorker(app, client)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker and P2P settings read KVTIER_* env vars; tests must not inherit any."""
    import os

    for name in list(os.environ):
        if name.startswith(("KVTIER_WORKER_", "KVTIER_P2P_")):
            monkeypatch.delenv(name)

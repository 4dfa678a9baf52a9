"""Fixtures for proxy tests: fake engines and a proxy, all real HTTP servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from loadtest.fake_backend import Behavior, FakeBackend
from pdproxy.app import ProxyState, create_app, proxy_state
from pdproxy.routing.base import (
    BackendView,
    RequestOutcome,
    RouteDecision,
    Router,
    RouteRequest,
)
from pdproxy.routing.simple import RoundRobinRouter
from pdproxy.settings import ProxySettings
from tests.conftest import free_port


class _InProcessServer(uvicorn.Server):
    """uvicorn in the test's event loop, leaving the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class RunningProxy:
    url: str
    state: ProxyState
    server: uvicorn.Server
    task: asyncio.Task[None]

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=10.0, **kwargs)


FakeFactory = Callable[..., Awaitable[FakeBackend]]
ProxyFactory = Callable[..., Awaitable[RunningProxy]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeFactory]:
    """``await fake("P", **behavior)`` starts a fake engine; all stop at teardown."""
    started: list[FakeBackend] = []

    async def make(name: str, **behavior: Any) -> FakeBackend:
        backend = await FakeBackend(name, Behavior(**behavior)).start()
        started.append(backend)
        return backend

    yield make
    for backend in started:
        await backend.stop()


def backend_entry(
    fb: FakeBackend, role: str, dialect: str = "nixl", **extra: Any
) -> dict[str, Any]:
    return {"name": fb.name, "url": fb.url, "role": role, "dialect": dialect, **extra}


def quick_settings(backends: list[dict[str, Any]], **overrides: Any) -> ProxySettings:
    """Settings for tests: no active health checks unless asked, short backoff."""
    values: dict[str, Any] = {
        "backends": backends,
        "health": {"enabled": False},
        "retries": {"backoff_base_s": 0.001, "backoff_max_s": 0.005},
    }
    values.update(overrides)
    return ProxySettings(**values)


@pytest.fixture
async def proxy() -> AsyncIterator[ProxyFactory]:
    """``await proxy(settings)`` runs pdproxy under uvicorn (httptools) on a free port."""
    running: list[RunningProxy] = []

    async def make(
        settings: ProxySettings, router: Router | None = None, **app_options: Any
    ) -> RunningProxy:
        app = create_app(settings, router=router, **app_options)
        port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            http="httptools",
            loop="none",
            access_log=False,
            log_level="warning",
            lifespan="on",
        )
        server = _InProcessServer(config)
        task = asyncio.get_running_loop().create_task(server.serve())
        for _ in range(500):
            if server.started:
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        proc = RunningProxy(f"http://127.0.0.1:{port}", proxy_state(app), server, task)
        running.append(proc)
        return proc

    yield make
    for proc in running:
        proc.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(proc.task, 10)


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    """Wait until ``check()`` holds (bounded), then assert it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert check()


class RecordingRouter:
    """Round-robin, recording every decision and every ``finished`` call."""

    def __init__(self) -> None:
        self._inner = RoundRobinRouter()
        self.decisions: list[RouteDecision] = []
        self.finished_calls: list[tuple[RouteDecision, RequestOutcome]] = []

    async def start(self) -> None:
        return None

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision:
        decision = await self._inner.route(request, producers, consumers)
        self.decisions.append(decision)
        return decision

    async def finished(self, decision: RouteDecision, outcome: RequestOutcome) -> None:
        self.finished_calls.append((decision, outcome))

    async def close(self) -> None:
        return None

    def assert_each_finished_once(self) -> None:
        finished = sorted(id(d) for d, _ in self.finished_calls)
        assert finished == sorted(id(d) for d in self.decisions)

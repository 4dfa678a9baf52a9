"""A bounded load through the proxy while membership changes: every answer must be whole."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from types import TracebackType

import httpx
import orjson


class Load:
    """``concurrency`` clients sending completions (stream and not, alternately) until stopped,
    at most ``max_requests`` in all and ``max_s`` seconds. An answer counts as ok only when it
    is a 200 whose body is whole (a non-stream JSON with choices, or a stream ending in
    ``[DONE]`` without an error event)."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 4,
        max_requests: int = 3000,
        max_s: float = 120.0,
        headers: dict[str, str] | None = None,
        max_tokens: int = 5,
        model: str = "m",
    ) -> None:
        self._url = url
        self._concurrency = concurrency
        self._max_requests = max_requests
        self._max_s = max_s
        self._headers = headers or {}
        self._max_tokens = max_tokens
        self._model = model
        self._stop = asyncio.Event()
        self._numbers = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self.sent = 0
        self.ok = 0
        self.failures: list[str] = []

    async def __aenter__(self) -> Load:
        client = httpx.AsyncClient(base_url=self._url, timeout=30.0, headers=self._headers)
        self._client = client
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + self._max_s
        self._tasks = [loop.create_task(self._client_loop()) for _ in range(self._concurrency)]
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    async def until(self, check: Callable[[], bool], timeout: float = 30.0) -> None:
        """Let the load run until ``check()`` holds (bounded; asserts it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not check() and loop.time() < deadline and not self._stop.is_set():
            await asyncio.sleep(0.02)
        assert check(), f"not reached under load (sent {self.sent}, ok {self.ok})"

    async def _client_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set() and loop.time() < self._deadline:
            n = next(self._numbers)
            if n >= self._max_requests:
                return
            stream = n % 2 == 0
            body = {
                "model": self._model,
                "prompt": f"request {n} " + "x" * (n % 37),
                "max_tokens": self._max_tokens,
                "stream": stream,
            }
            self.sent += 1
            try:
                problem = await self._one(body, stream)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                self.ok += 1
            else:
                self.failures.append(f"request {n}: {problem}")

    async def _one(self, body: dict[str, object], stream: bool) -> str | None:
        async with self._client.stream("POST", "/v1/completions", json=body) as response:
            data = await response.aread()
        if response.status_code != 200:
            return f"status {response.status_code}: {data[:200]!r}"
        if stream:
            if not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data:
                return f"broken stream: {data[-200:]!r}"
            return None
        parsed = orjson.loads(data)
        return None if parsed.get("choices") else f"no choices: {data[:200]!r}"

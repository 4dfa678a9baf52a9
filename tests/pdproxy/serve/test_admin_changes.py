"""Admin changes in a ``serve --workers N`` process: the key first, then a bounded body, then
the siblings (issue 30 finding 2).

The app is driven through ASGI directly, with a ``receive`` that records whether the body was
ever asked for: an unkeyed change (or any change with the admin API off) must be answered
without it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.types import Message

from pdproxy.app import create_app
from pdproxy.serve.siblings import Siblings
from tests.pdproxy.conftest import quick_settings

ADMIN_KEY = "admin-key-for-the-admin-changes-test"


class _Client:
    """One ASGI request: ``body`` handed out in pieces (``None``: never ends)."""

    def __init__(self, body: list[bytes] | None) -> None:
        self._body = body
        self.reads = 0
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        self.reads += 1
        if self._body is None:
            await asyncio.sleep(3600)
        assert self._body is not None
        chunk = self._body.pop(0) if self._body else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(self._body)}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])


def _scope(path: str, key: str | None, length: int) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % length)]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("203.0.113.9", 4000),
        "server": ("127.0.0.1", 8000),
    }  # fmt: skip


def _app(tmp_path: Path, admin_key: str | None, **overrides: Any) -> Any:
    settings = quick_settings([], admin_key=admin_key, **overrides)
    return create_app(settings, siblings=Siblings(tmp_path, 0, 2))


@pytest.mark.parametrize(("key", "status"), [(None, 401), ("wrong", 401)])
async def test_an_unkeyed_change_is_refused_before_its_body_is_read(
    tmp_path: Path, key: str | None, status: int
) -> None:
    app = _app(tmp_path, ADMIN_KEY)
    client = _Client(None)  # a body that never ends: reading it would hang the test
    await asyncio.wait_for(
        app(_scope("/admin/backends", key, 4 * 2**20), client.receive, client.send), 5
    )
    assert client.status == status
    assert client.reads == 0


async def test_with_the_admin_api_off_a_change_is_404_before_its_body_is_read(
    tmp_path: Path,
) -> None:
    app = _app(tmp_path, None)
    client = _Client(None)
    await asyncio.wait_for(
        app(_scope("/admin/backends", ADMIN_KEY, 100), client.receive, client.send), 5
    )
    assert client.status == 404
    assert client.reads == 0


async def test_a_keyed_change_has_a_bounded_body_and_read_time(tmp_path: Path) -> None:
    app = _app(tmp_path, ADMIN_KEY, admission={"body_read_timeout_s": 0.2})
    big = _Client([b"x" * 65536] * 4)
    await app(_scope("/admin/backends", ADMIN_KEY, 4 * 65536), big.receive, big.send)
    assert big.status == 413
    assert big.reads <= 2  # refused as soon as it passed the admin bound, not at 4 MiB
    slow = _Client(None)
    await asyncio.wait_for(
        app(_scope("/admin/backends", ADMIN_KEY, 100), slow.receive, slow.send), 5
    )
    assert slow.status == 408


async def test_a_keyed_change_is_made_here_even_when_no_sibling_answers(tmp_path: Path) -> None:
    app = _app(tmp_path, ADMIN_KEY)
    body = orjson.dumps(
        {"name": "d2", "url": "http://127.0.0.1:9", "role": "consumer", "dialect": "nixl"}
    )
    client = _Client([body])
    await app(_scope("/admin/backends", ADMIN_KEY, len(body)), client.receive, client.send)
    assert client.status == 201
    assert app.pdproxy_state.registry.get("d2") is not None

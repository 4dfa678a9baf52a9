"""How the processes of one ``pdproxy serve --workers N`` reach each other.

Each process serves its app on a private Unix socket as well as on the shared port
(:mod:`pdproxy.serve.process_group`). Over it, and only over it, a process answers as itself alone:

- ``GET /metrics`` over the shared port collects every sibling's own metrics over their
  Unix sockets and answers the sum (:mod:`pdproxy.serve.metrics_merge`), so a scrape sees the
  proxy as a whole whichever process it reaches;
- an admin change (``POST``/``DELETE`` under ``/admin/``) that succeeds over the shared port is
  replayed, with the same authorization, to every sibling, so all processes route alike.

Threat model: the Unix sockets sit in a 0700 directory made by the supervisor, so only its user
(and root) can connect; a request over them is still a normal request (the admin API still
needs the admin key); it only skips the fan-out. Nothing arriving over TCP can ask for
"this process only" behaviour: that is decided by the socket a request arrived on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdproxy.errors import ClientRequestError
from pdproxy.front.intake import read_body
from pdproxy.front.responses import client_error_response

log = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


@dataclass(frozen=True, slots=True)
class Siblings:
    directory: Path
    index: int
    count: int

    @property
    def own_path(self) -> str:
        return str(self.directory / f"{self.index}.sock")

    def others(self) -> list[Path]:
        return [self.directory / f"{i}.sock" for i in range(self.count) if i != self.index]

    def is_sibling_request(self, server: object) -> bool:
        """True for a request that arrived on this process's Unix socket (ASGI ``server``)."""
        return isinstance(server, tuple | list) and bool(server) and server[0] == self.own_path

    async def _call(
        self, path: Path, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes] | None:
        try:
            connector = aiohttp.UnixConnector(path=str(path))
            async with (
                aiohttp.ClientSession(connector=connector, timeout=_TIMEOUT) as session,
                session.request(
                    method, "http://sibling" + target, headers=headers, data=body
                ) as resp,
            ):
                return resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("sibling %s did not answer %s %s: %s", path.name, method, target, exc)
            return None

    async def fan_out(
        self, method: str, target: str, headers: dict[str, str], body: bytes = b""
    ) -> list[tuple[int, bytes] | None]:
        """The same request to every other process (None where one did not answer)."""
        calls = (self._call(p, method, target, headers, body) for p in self.others())
        return list(await asyncio.gather(*calls))

    def is_admin_change_to_share(self, scope: Scope) -> bool:
        """An admin change that arrived over the shared port (not from a sibling)."""
        return (
            scope["type"] == "http"
            and scope["method"] in ("POST", "DELETE")
            and scope["path"].startswith("/admin/")
            and not self.is_sibling_request(scope.get("server"))
        )

    async def share_admin_change(
        self,
        app: ASGIApp,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        max_body: int,
        timeout_s: float,
    ) -> None:
        """The admin change made here by ``app``, then, when it succeeded, in every sibling.

        The caller has checked the admin key already: only then is the body read (at most
        ``max_body`` bytes within ``timeout_s``), since it is held whole to be replayed."""
        try:
            body = await read_body(receive, max_body, timeout_s)
        except ClientRequestError as exc:
            await client_error_response(exc)(scope, receive, send)
            return
        except ClientDisconnect:
            return  # the client left before its request was complete: nothing to change
        status = 0

        async def replay() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await app(scope, replay, watch)
        if not 200 <= status < 300:
            return
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"authorization", b"content-type")
        }
        query = scope.get("query_string", b"")
        target = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        for answer in await self.fan_out(scope["method"], target, headers, body):
            if answer is None or not 200 <= answer[0] < 300:
                log.error(
                    "an admin change did not reach every proxy process: %s %s",
                    scope["method"], scope["path"],
                )  # fmt: skip

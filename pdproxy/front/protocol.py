"""``pdproxy serve``'s HTTP protocol: uvicorn's httptools protocol that reports a client's
disconnect to the request at once, through its ASGI scope, instead of through ``receive``.

Noticing a client leaving through ASGI takes a task per request blocked in ``receive()``
(:class:`pdproxy.front.cancel.RequestCanceller`'s fallback): creating, scheduling and cancelling it
was ~6% of the instructions of a proxied request. Here each request's scope carries a
:class:`DisconnectHook`; when the connection is lost while the request runs, the protocol calls
the hook's callback right after uvicorn marked the request disconnected (the moment the watcher
task would have woken). Apps served by anything else see no hook and keep the watcher.

The request object of the two hot routes: Starlette's, with headers looked up in O(1).

Starlette's ``Headers.get`` scans the header list and raises (then catches) ``KeyError`` for an
absent header; the request path asks for four or five headers, most of them absent
(``x-request-id``, ``traceparent``, ``baggage``, ...). Here the list is indexed once, keeping
Starlette's answer for a repeated header (the first one), so behaviour is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DISCONNECT_HOOK = "pdproxy.disconnect_hook"
"""Scope key of the request's :class:`DisconnectHook` (absent: no such server)."""


class DisconnectHook:
    """Set by the server per request: ``lost`` once the client left while the request ran,
    and ``callback`` (set by the request) called then."""

    __slots__ = ("callback", "lost")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.lost = False


class ProxyHttpProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT_HOOK] = DisconnectHook()  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            hook = cycle.scope.get(DISCONNECT_HOOK)
            if isinstance(hook, DisconnectHook):
                hook.lost = True
                callback, hook.callback = hook.callback, None
                if callback is not None:
                    callback()


class IndexedHeaders(Headers):
    """:class:`Headers` whose ``get``/``[]``/``in`` use a dict of each name's first value."""

    def __init__(self, scope: MutableMapping[str, Any]) -> None:
        super().__init__(scope=scope)
        first: dict[bytes, bytes] = {}
        for key, value in reversed(self._list):  # names are lower case in ASGI
            first[key] = value
        self._first = first

    def get(self, key: str, default: Any = None) -> Any:
        value = self._first.get(key.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __getitem__(self, key: str) -> str:
        value = self._first.get(key.lower().encode("latin-1"))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower().encode("latin-1") in self._first


class HotRequest(Request):
    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_headers"):
            self._headers = IndexedHeaders(self.scope)
        return self._headers

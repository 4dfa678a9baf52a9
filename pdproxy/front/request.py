"""The client request as the request path reads it, whichever server delivered it.

:class:`ClientRequest` is what :meth:`pdproxy.request.path.RequestPath.handle` needs: the
headers, ASGI's ``receive`` (the body, a disconnect) and a scope that may carry the server's
:class:`DisconnectHook`. Starlette's ``Request`` is one (:class:`HotRequest` under any ASGI
server); :class:`pdproxy.front.direct.DirectExchange` is the other (``pdproxy serve``'s direct
hot routes; it also offers the body that has all arrived, ``arrived``).

Headers are looked up in O(1) (:class:`IndexedHeaders`): Starlette's ``Headers.get`` scans the
header list and raises (then catches) ``KeyError`` for an absent header; the request path asks
for four or five headers, most of them absent (``x-request-id``, ``traceparent``, ``baggage``,
...). The list is indexed once, keeping Starlette's answer for a repeated header (the first
one), so behaviour is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Receive

DISCONNECT_HOOK = "pdproxy.disconnect_hook"
"""Scope key of the request's :class:`DisconnectHook` (absent: no such server)."""


class DisconnectHook:
    """Set by the server per request: ``lost`` once the client left while the request ran,
    and ``callback`` (set by the request) called then."""

    __slots__ = ("callback", "lost")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.lost = False


class ClientRequest(Protocol):
    """A client request as the request path reads it (Starlette's ``Request`` is one)."""

    @property
    def headers(self) -> Headers: ...

    @property
    def receive(self) -> Receive: ...

    @property
    def scope(self) -> Mapping[str, Any]: ...


_NAMES: dict[str, bytes] = {}
"""The raw names of the header names looked up (the path's constants: a few dozen)."""
_MAX_NAMES = 256


def _name(key: str) -> bytes:
    name = key.lower().encode("latin-1")
    if len(_NAMES) < _MAX_NAMES:  # bounded whoever calls
        _NAMES[key] = name
    return name


class IndexedHeaders(Headers):
    """:class:`Headers` whose ``get``/``[]``/``in`` use a dict of each name's first value."""

    def __init__(self, scope: MutableMapping[str, Any]) -> None:
        super().__init__(scope=scope)
        self._index()

    @classmethod
    def of(cls, raw: list[tuple[bytes, bytes]]) -> IndexedHeaders:
        """Over a server's raw list (lower-case names), without a scope; the list is not
        copied (the server is done with it)."""
        headers = cls.__new__(cls)
        headers._list = raw
        headers._index()
        return headers

    def _index(self) -> None:
        first: dict[bytes, bytes] = {}
        for key, value in reversed(self._list):  # names are lower case in ASGI
            first[key] = value
        self._first = first

    def get(self, key: str, default: Any = None) -> Any:
        name = _NAMES.get(key)
        if name is None:
            name = _name(key)
        value = self._first.get(name)
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

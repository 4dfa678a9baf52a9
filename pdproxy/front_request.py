"""The request object of the two hot routes: Starlette's, with headers looked up in O(1).

Starlette's ``Headers.get`` scans the header list and raises (then catches) ``KeyError`` for an
absent header; the request path asks for four or five headers, most of them absent
(``x-request-id``, ``traceparent``, ``baggage``, ...). Here the list is indexed once, keeping
Starlette's answer for a repeated header (the first one), so behaviour is unchanged.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request


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

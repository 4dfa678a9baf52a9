"""The proxy's own view of its backends (``GET /admin/backends``), for the status board."""

from __future__ import annotations

import logging
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class ProxyBackendsView:
    """Reads the proxy's admin API with the stack's admin key; empty when unavailable."""

    def __init__(self, endpoint: str, admin_key: str, timeout_s: float = 1.0) -> None:
        self._url = endpoint + "/admin/backends"
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._http = httpx.Client(timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def details(self) -> dict[str, str]:
        """Backend name → e.g. ``in_flight=2 routable`` or ``in_flight=0 NOT ROUTABLE (...)``."""
        try:
            resp = self._http.get(self._url, headers=self._headers)
        except httpx.HTTPError as exc:
            logger.debug("admin API unavailable: %r", exc)
            return {}
        if resp.status_code != 200:
            return {}
        try:
            doc: Any = resp.json()
        except ValueError:
            return {}
        items = doc.get("backends", doc) if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            return {}
        return {str(b["name"]): _describe(b) for b in items if isinstance(b, dict) and "name" in b}


def _describe(backend: dict[str, Any]) -> str:
    text = f"in_flight={backend.get('in_flight', '?')}"
    if backend.get("routable", True):
        return text + " routable"
    why = [
        k
        for k, bad in (
            ("unhealthy", not backend.get("healthy", True)),
            ("draining", backend.get("draining", False)),
            (f"breaker {backend.get('breaker')}", backend.get("breaker") not in (None, "closed")),
        )
        if bad
    ]
    return text + " NOT ROUTABLE" + (f" ({', '.join(why)})" if why else "")

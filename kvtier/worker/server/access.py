"""The worker's HTTP gate: who may call which route, and how large a body may be.

Who may connect: the proxy, and nothing else once ``api_key`` (``KVTIER_WORKER_API_KEY``) is
set. What a caller can make the worker do: run completions (compute, fill the prefix cache),
supply this worker's KV pages to a consumer (producer legs), connect to a producer named in the
request and install the pages it sends (consumer legs; bounded by ``p2p_allowed_peers``), and
drop any supply (``POST /v1/kv/release``). So, with a key set, every route needs
``Authorization: Bearer <key>`` (compared in constant time), as vLLM's ``--api-key`` guards
every ``/v1`` route, so the proxy's per-backend ``api_key`` works for both engines — except:

- ``GET /health``: liveness probes (the proxy's health checks send the backend's key anyway);
- ``GET /metrics``: Prometheus scrapes; counters and gauges only, no prompt, id or key.

Without a key the worker trusts its network (loopback by default: ``host`` is ``127.0.0.1``).

Bodies: a declared ``Content-Length`` over ``max_body_bytes`` is refused with 413 before any
byte is read; a body without one (chunked) is counted as it arrives and refused at the limit,
so no request makes the worker hold more than the limit.
"""

from __future__ import annotations

import hmac
import logging

from pydantic import SecretStr
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.worker.server.openai_format import error_response
from kvtier.worker.stats import EngineStats

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Routes that need no key even when one is set."""


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes the limit; FastAPI lets HTTP exceptions
    through its body parsing, so the app's handler answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than {limit} bytes")


class WorkerGate:
    """ASGI middleware in front of the whole app (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: SecretStr | None,
        max_body_bytes: int,
        stats: EngineStats,
    ) -> None:
        self.app = app
        key = api_key.get_secret_value() if api_key is not None else ""
        self._key = key.encode() if key else None
        self._max_body = max_body_bytes
        self._stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            self._stats.unauthorized_requests += 1
            response = error_response(
                401, "missing or invalid API key", err_type="AuthenticationError"
            )
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._max_body:
            self._stats.oversized_bodies += 1
            await error_response(
                413, f"request body larger than {self._max_body} bytes", err_type="BadRequestError"
            )(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max_body:
                    self._stats.oversized_bodies += 1
                    raise BodyTooLarge(self._max_body)
            return message

        return limited


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (h11/httptools) refuses it before the app runs
    return None

"""Typed errors of pdproxy.

Hierarchy::

    ProxyError
    ├── ConfigError            settings that cannot work (unknown router, duplicate backend names)
    ├── NoBackendAvailable     no routable consumer exists (503)
    ├── ClientRequestError     the client's request is refused before any leg (status + code)
    │   ├── BodyTooLarge       413 while reading the body
    │   ├── BodyReadTimeout    408: the body did not arrive within its deadline
    │   ├── Overloaded         admission queue full or wait timed out (429 + Retry-After)
    │   └── ModelNotFound      the request names a model no backend serves (404)
    ├── LegFailed              an upstream leg failed (connect, timeout, retryable status)
    │   └── KvAddressMismatch  a producer named a KV address other than its configured one
    ├── LegRefused             an upstream answered a client error (4xx): relayed as is
    └── HttpClientError        the upstream HTTP/1.1 client (pdproxy.upstream.pool): the connection
        │                      failed or closed early, or the answer is not acceptable HTTP/1.1
        ├── RequestNotSent     provably nothing was sent (connect failed or timed out)
        ├── ResponseHeadTooLarge  the response head (or trailers) passed the byte/field caps
        └── ResponseTooLarge   an answer read whole passed ``upstream.max_answer_bytes``

``HttpClientError`` stays inside the upstream layer: :mod:`pdproxy.upstream.client` translates it
into ``LegFailed`` (``raise ... from exc``).

``ClientRequestError`` carries the HTTP status and the OpenAI error ``type``/``code`` so the
request path answers with OpenAI-shaped JSON without guessing.
"""

from __future__ import annotations


class ProxyError(Exception):
    """Base of every error pdproxy raises on purpose."""


class ConfigError(ProxyError, ValueError):
    """Settings that cannot work."""


class NoBackendAvailable(ProxyError):
    """No routable consumer exists (the request path answers 503)."""


class ClientRequestError(ProxyError):
    """A client request refused by the proxy itself, with its HTTP status and error code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        code: str = "invalid_request",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.headers = headers or {}


class BodyTooLarge(ClientRequestError):
    """The request body exceeded the configured limit while it was read (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"request body exceeds {limit} bytes",
            code="request_too_large",
        )


class BodyReadTimeout(ClientRequestError):
    """The body did not arrive within ``body_read_timeout_s`` (408; the connection is closed)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"request body not received within {timeout_s:g} s",
            code="request_timeout",
            headers={"connection": "close"},
        )


class Overloaded(ClientRequestError):
    """Admission refused the request: the wait queue is full or the wait timed out (429)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(
            429,
            message,
            error_type="rate_limit_error",
            code="overloaded",
            headers={"retry-after": str(retry_after_s)},
        )


class ModelNotFound(ClientRequestError):
    """The request's ``model`` is served by no backend (OpenAI's 404 ``model_not_found``)."""

    def __init__(self, model: str) -> None:
        shown = model if len(model) <= 256 else model[:256] + "..."
        super().__init__(
            404,
            f"The model `{shown}` does not exist or you do not have access to it.",
            code="model_not_found",
        )
        self.model = model


class LegFailed(ProxyError):
    """An upstream leg failed in a way that retrying elsewhere may fix.

    ``status`` is the upstream HTTP status when one arrived (5xx, 429), else None (connect
    error, timeout, reset). ``body`` holds the upstream error body when one was read.
    """

    def __init__(
        self,
        backend: str,
        reason: str,
        *,
        status: int | None = None,
        body: bytes = b"",
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"{backend}: {reason}")
        self.backend = backend
        self.reason = reason
        self.status = status
        self.body = body
        self.timed_out = timed_out


class LegRefused(ProxyError):
    """An upstream answered a non-retryable client error (4xx other than 408/429).

    Retrying elsewhere would fail the same way, so the request path relays it to the client.
    """

    def __init__(self, backend: str, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{backend}: refused with {status}")
        self.backend = backend
        self.status = status
        self.body = body
        self.content_type = content_type


class KvAddressMismatch(LegFailed):
    """A producer's answer named a ``remote_host``/``remote_port`` other than the KV address
    configured for it: the consumer must not be sent there."""


class HttpClientError(ProxyError):
    """The upstream connection failed, closed early, or answered something not acceptable."""


class RequestNotSent(HttpClientError):
    """Nothing of the request left the proxy (connect failed or timed out): safe to resend."""


class ResponseHeadTooLarge(HttpClientError):
    """The upstream's response head or trailers passed the configured byte or field caps."""


class ResponseTooLarge(HttpClientError):
    """An upstream answer read whole (not streamed) passed the configured byte cap."""

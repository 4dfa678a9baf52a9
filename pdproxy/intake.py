"""Taking a client request in: its API key and its body (size-limited while read)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request

from pdproxy.errors import BodyTooLarge, ClientRequestError
from pdproxy.headers import bearer_token
from pdproxy.settings import ApiKey


class ClientKeys:
    """The configured client keys; none configured means no authentication."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._trusted = {k.key.get_secret_value(): k.trusted for k in keys}

    def authenticate(self, headers: Headers) -> bool:
        """Check the caller's bearer key; return whether it is trusted. 401 if wrong."""
        if not self._trusted:
            return False
        token = bearer_token(headers)
        trusted = self._trusted.get(token) if token is not None else None
        if trusted is None:
            raise ClientRequestError(401, "invalid or missing API key", code="invalid_api_key")
        return trusted


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)

"""Tenants: which prompts may share the engines' prefix caches, and who sees ``cached_tokens``.

Engines reuse a cached prefix whenever two prompts hash alike, and report how much they reused
(``usage.prompt_tokens_details.cached_tokens``); a shared cache therefore tells one client, by
that figure or by its speed, which prompts another sent. vLLM (and the reference worker) mix a
request's ``cache_salt`` into its first block's hash, so requests with different salts never
share a block. This module gives each tenant its own salt and hides the figure from keys not
allowed to see it (the threat model: ``docs/security.md``, "Tenants").

- :class:`CacheSalts`: the request path's :meth:`~CacheSalts.salted` sets ``cache_salt`` in the
  client's body once, before routing, so the router's hashes, the producer leg and the consumer
  leg all carry the same one. The salt is an HMAC-SHA256, under a secret of the proxy's, of the
  tenant and of the salt the client sent, if any: a client may split its own tenant's cache
  further (vLLM's intended use of ``cache_salt``) but no salt it sends yields another tenant's
  (it would need the secret). Called on the event loop, once per request; no I/O.
- :func:`hide_cached_tokens` and :class:`CachedTokensHidden`: every ``cached_tokens`` of an answer
  shown as 0 (a never-cached prompt's figure) to a key without ``see_cached_tokens``; only the
  digits change, in place (nothing is parsed or re-serialised).
"""

from __future__ import annotations

import hashlib
import hmac
import re

from starlette.types import Message, Send

from pdproxy.errors import ClientRequestError
from pdproxy.front.intake import Caller, ClientBody, TenantId


class CacheSalts:
    """Derives each tenant's ``cache_salt`` (one per app; stateless after construction)."""

    __slots__ = ("_plain", "_secret")

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._plain: dict[TenantId, str] = {}
        """Each tenant's salt without a client salt (the common case), made once: one entry per
        configured tenant at most."""

    def salt(self, tenant: TenantId, client_salt: str | None) -> str:
        """The salt a request of ``tenant`` carries upstream. The tenant is length-prefixed, so
        no (tenant, client salt) pair is read as another one."""
        name = tenant.encode("utf-8", "surrogatepass")
        message = b"%d:%s" % (len(name), name)
        if client_salt is not None:
            message += client_salt.encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def salted(self, caller: Caller, body: ClientBody) -> ClientBody:
        """``body`` with its tenant's ``cache_salt`` (unchanged when the caller has no tenant of
        its own). 400 when the client sent a ``cache_salt`` that is not a non-empty string
        (what vLLM would refuse too)."""
        tenant = caller.tenant
        if tenant is None:
            return body
        data = body.data
        sent = data.get("cache_salt")
        if sent is not None and (not isinstance(sent, str) or not sent):
            raise ClientRequestError(400, "cache_salt must be a non-empty string")
        salted = dict(data)
        if sent is None:
            salt = self._plain.get(tenant)
            if salt is None:
                salt = self._plain[tenant] = self.salt(tenant, None)
        else:
            salt = self.salt(tenant, sent)
        salted["cache_salt"] = salt
        return ClientBody(raw=body.encode(salted), data=salted, exact_ints=body.exact_ints)


_CACHED_TOKENS = re.compile(rb'("cached_tokens"\s*:\s*)\d+')
_MARK = b'"cached_tokens"'


def hide_cached_tokens(data: bytes) -> bytes:
    """``data`` with every ``"cached_tokens": N`` made ``"cached_tokens": 0`` (the rest, spacing
    included, byte for byte)."""
    if _MARK not in data:
        return data
    return _CACHED_TOKENS.sub(rb"\g<1>0", data)


def _event_end(data: bytes) -> int:
    """Where the last complete server-sent event of ``data`` ends (0: none is complete)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class CachedTokensHidden:
    """An ASGI ``send`` for a relayed stream that shows every ``cached_tokens`` as 0.

    Wraps the server's ``send`` for one stream, on the event loop. An event the engine split
    across reads is held back until it is complete (the figure could straddle two reads); a
    read that ends on an event boundary, as engines write them, is sent on at once and untouched
    unless it holds the figure (the usage chunk)."""

    __slots__ = ("_held", "_send")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._held = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if self._held:
            body = self._held + body
            self._held = b""
        if more and not body.endswith(b"\n\n"):
            end = _event_end(body)
            self._held = body[end:]
            body = body[:end]
            if not body:
                return
        if _MARK in body:
            body = _CACHED_TOKENS.sub(rb"\g<1>0", body)
        await self._send({"type": "http.response.body", "body": body, "more_body": more})

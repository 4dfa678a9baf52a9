"""A request's session, for session affinity: ``x-session-id`` or the OpenAI ``user`` field.

Threat model: the id is the client's own text and names nothing on our side. It is bounded in
length (a longer one is ignored: no affinity) and scoped by the client's bearer key, so a client
can only steer the sessions of its own key; what a session steers is a ranking preference that
the hot-spot guard overrides (:mod:`pdproxy.routing.kv.scorers.affinity`), never a backend
choice the client names. The id never reaches an engine and is not logged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NewType

from starlette.datastructures import Headers

from pdproxy.front.intake import bearer_token

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256

SessionId = NewType("SessionId", str)
"""A session as the router sees it: the client's key fingerprint and its id, joined."""


def session_of(
    headers: Headers, body: Mapping[str, Any], key_scope: str | None = None
) -> SessionId | None:
    """The request's session (header first, then ``user``), scoped by the caller's key; None
    when there is none or it is unusable (empty, not a string, too long).

    ``key_scope``: the authenticated key's scope (:attr:`pdproxy.front.intake.Caller.key_scope`),
    so the key is not parsed again; without one (no keys configured), the bearer token the
    client sent is hashed here."""
    given: object = headers.get(SESSION_HEADER)
    if given is None:
        given = body.get("user")
    if not isinstance(given, str) or not 0 < len(given) <= MAX_SESSION_ID_CHARS:
        return None
    scope = key_scope
    if scope is None:
        token = bearer_token(headers) or ""
        scope = hashlib.blake2b(token.encode(), digest_size=8).hexdigest()
    return SessionId(f"{scope}:{given}")

"""Admin API: list, add, remove and drain backends at run time (admin key required);
``GET /admin/members`` lists the backends DNS discovery and worker registration added and the
removed ones no source may bring back; ``POST /admin/members/{name}/readmit`` takes a removal
back; ``POST /admin/registration/reload-keys`` re-reads the registration keys now.

Off unless ``admin_key`` is set. Changes live in memory only: the config file stays the
source of truth on restart.

Nothing is read of a request before its key is checked (:meth:`AdminApi.refusal`, also called by
``pdproxy serve --workers N`` before it reads an admin change to replay to the other processes);
a body is then at most :data:`MAX_ADMIN_BODY_BYTES`, read within ``body_read_timeout_s``.
"""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from pdproxy.errors import ClientRequestError, ConfigError
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.membership.service import MembershipService
from pdproxy.front.intake import bearer_token, read_body
from pdproxy.front.responses import client_error_response, error_response
from pdproxy.settings import BackendConfig, validation_error_text

MAX_ADMIN_BODY_BYTES = 64 * 1024
"""An admin body is one backend's settings (well under 1 KiB); the client bound
(``max_body_bytes``, 4 MiB) is for prompts."""


def backend_state(backend: Backend) -> dict[str, Any]:
    return {
        "name": backend.name,
        "url": backend.url,
        "role": backend.role.value,
        "dialect": backend.dialect.value,
        "healthy": backend.healthy,
        "draining": backend.draining,
        "breaker": backend.breaker.state.name.lower(),
        "routable": backend.routable,
        "in_flight": backend.in_flight,
    }


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class AdminApi:
    def __init__(
        self,
        registry: BackendRegistry,
        admin_key: str | None,
        membership: MembershipService | None = None,
        *,
        body_read_timeout_s: float = 30.0,
    ) -> None:
        self._registry = registry
        self._key = admin_key
        self._membership = membership
        self._body_read_timeout_s = body_read_timeout_s

    def routes(self) -> list[Route]:
        return [
            Route("/admin/backends", self._list, methods=["GET"]),
            Route("/admin/backends", self._add, methods=["POST"]),
            Route("/admin/backends/{name}", self._remove, methods=["DELETE"]),
            Route("/admin/backends/{name}/drain", self._drain, methods=["POST"]),
            Route("/admin/backends/{name}/undrain", self._undrain, methods=["POST"]),
            Route("/admin/members", self._members, methods=["GET"]),
            Route("/admin/members/{name}/readmit", self._readmit, methods=["POST"]),
            Route("/admin/registration/reload-keys", self._reload_keys, methods=["POST"]),
        ]

    def refusal(self, headers: Headers) -> Response | None:
        """The answer to a request with these headers when it may not use the admin API (404
        when it is off, 401 without the admin key); None when it may. Reads no body."""
        if self._key is None:
            return error_response(
                404, "the admin API is disabled (no admin_key)", code="admin_disabled"
            )
        token = bearer_token(headers) or ""
        if not hmac.compare_digest(token.encode(), self._key.encode()):
            return error_response(
                401, "invalid admin key", error_type="invalid_request_error",
                code="invalid_api_key",
            )  # fmt: skip
        return None

    async def _list(self, request: Request) -> Response:
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        return _json({"backends": [backend_state(b) for b in self._registry.all()]})

    async def _members(self, request: Request) -> Response:
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        if self._membership is None:
            return _json({"members": [], "removed": []})
        removed = [
            {"name": name, "source": source, "owner": owner}
            for name, (source, owner) in sorted(self._membership.membership.removed().items())
        ]
        return _json({"members": self._membership.view(), "removed": removed})

    async def _readmit(self, request: Request) -> Response:
        """A removed member's source may add it again (its removal stuck until now)."""
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        name = request.path_params["name"]
        if self._membership is None or not self._membership.membership.readmit(name):
            return error_response(
                404, f"no removed member {name!r}", error_type="invalid_request_error",
                code="unknown_member",
            )  # fmt: skip
        return _json({"name": name, "readmitted": True})

    async def _reload_keys(self, request: Request) -> Response:
        """Re-read the registration keys now (revoked keys' backends drain at once)."""
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        change = (
            self._membership.registration.reload_keys() if self._membership is not None else None
        )
        return _json(
            {
                "changed": change is not None,
                "added": len(change.added) if change is not None else 0,
                "revoked": len(change.revoked) if change is not None else 0,
            }
        )

    async def _add(self, request: Request) -> Response:
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        try:
            body = await read_body(request.receive, MAX_ADMIN_BODY_BYTES, self._body_read_timeout_s)
        except ClientRequestError as exc:
            return client_error_response(exc)
        except ClientDisconnect:
            return error_response(400, "the client left", code="client_disconnected")
        try:
            config = BackendConfig.model_validate_json(body)
            backend = self._registry.add(config)
        except ValidationError as exc:
            return error_response(
                400, f"invalid backend: {validation_error_text(exc)}",
                error_type="invalid_request_error", code="invalid_backend",
            )  # fmt: skip
        except ConfigError as exc:
            return error_response(
                409, str(exc), error_type="invalid_request_error", code="backend_exists"
            )
        return _json(backend_state(backend), 201)

    def _named(self, request: Request) -> Backend | Response:
        name = request.path_params["name"]
        backend = self._registry.get(name)
        if backend is None:
            return error_response(
                404, f"no backend {name!r}", error_type="invalid_request_error",
                code="unknown_backend",
            )  # fmt: skip
        return backend

    async def _remove(self, request: Request) -> Response:
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        found = self._named(request)
        if isinstance(found, Response):
            return found
        self._registry.remove(found.name)
        return _json(backend_state(found))

    async def _drain(self, request: Request) -> Response:
        return await self._set_draining(request, True)

    async def _undrain(self, request: Request) -> Response:
        return await self._set_draining(request, False)

    async def _set_draining(self, request: Request, draining: bool) -> Response:
        if (refused := self.refusal(request.headers)) is not None:
            return refused
        found = self._named(request)
        if isinstance(found, Response):
            return found
        found.draining = draining
        return _json(backend_state(found))

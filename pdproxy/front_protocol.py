"""``pdproxy serve``'s HTTP protocol: uvicorn's httptools protocol that reports a client's
disconnect to the request at once, through its ASGI scope, instead of through ``receive``.

Noticing a client leaving through ASGI takes a task per request blocked in ``receive()``
(:class:`pdproxy.cancel.RequestCanceller`'s fallback): creating, scheduling and cancelling it
was ~6% of the instructions of a proxied request. Here each request's scope carries a
:class:`DisconnectHook`; when the connection is lost while the request runs, the protocol calls
the hook's callback right after uvicorn marked the request disconnected (the moment the watcher
task would have woken). Apps served by anything else see no hook and keep the watcher.
"""

from __future__ import annotations

from collections.abc import Callable

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

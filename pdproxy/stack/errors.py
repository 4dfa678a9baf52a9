"""Typed errors of the local stack (``pdproxy up``).

Hierarchy (under ``pdproxy.errors.ProxyError``)::

    StackError               the local stack cannot run
    ├── StartupFailed        a process exited or never became healthy during start-up
    └── ProcessExited        a process died while the stack was serving
"""

from __future__ import annotations

from pdproxy.errors import ProxyError


class StackError(ProxyError):
    """The local stack cannot run."""


class StartupFailed(StackError):
    """A process exited or did not become healthy in time while the stack started."""


class ProcessExited(StackError):
    """A process of a running stack exited on its own."""

"""Backends and their registry: health, breaker, drain state and in-flight counts."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdproxy.breaker import CircuitBreaker
from pdproxy.errors import ConfigError
from pdproxy.routing.base import Role
from pdproxy.settings import BackendConfig, BreakerSettings, Dialect


class Backend:
    """One upstream engine. Satisfies :class:`pdproxy.routing.base.BackendView`."""

    __slots__ = (
        "_in_flight",
        "auth_header",
        "breaker",
        "config",
        "draining",
        "health_failures",
        "health_successes",
        "healthy",
        "kv_address",
        "removed",
    )

    def __init__(self, config: BackendConfig, breaker: CircuitBreaker) -> None:
        self.config = config
        self.breaker = breaker
        self.healthy = True
        self.draining = False
        self.removed = False
        self.health_successes = 0
        self.health_failures = 0
        self._in_flight = 0
        key = config.api_key.get_secret_value() if config.api_key is not None else ""
        self.auth_header: str | None = f"Bearer {key}" if key else None
        self.kv_address = config.kv_host_port
        """Where this producer's answers must say its KV is (None: not checked)."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def role(self) -> Role:
        return self.config.role

    @property
    def dialect(self) -> Dialect:
        return self.config.dialect

    @property
    def events_endpoint(self) -> str | None:
        return self.config.events_endpoint

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and not self.removed and self.breaker.allows()

    def serves(self, role: Role) -> bool:
        return self.config.role is role or self.config.role is Role.BOTH

    def begin(self) -> None:
        """A leg is about to be sent: count it in flight (and as the half-open probe). Called
        only by :class:`pdproxy.lease.BackendHold`, which calls :meth:`end` exactly once."""
        self.breaker.on_attempt()
        self._in_flight += 1

    def end(self) -> None:
        self._in_flight -= 1


class BackendRegistry:
    """The live set of backends: static config plus admin additions and removals."""

    def __init__(
        self, breaker_settings: BreakerSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._breaker_settings = breaker_settings
        self._clock = clock
        self._backends: dict[str, Backend] = {}

    def add(self, config: BackendConfig) -> Backend:
        if config.name in self._backends:
            raise ConfigError(f"backend {config.name!r} already exists")
        backend = Backend(config, CircuitBreaker(self._breaker_settings, self._clock))
        self._backends[config.name] = backend
        return backend

    def remove(self, name: str) -> Backend:
        backend = self._backends.pop(name, None)
        if backend is None:
            raise KeyError(name)
        backend.removed = True
        return backend

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def producers(self) -> list[Backend]:
        """Routable producers (aggregated ``none``-dialect backends never produce)."""
        return [
            b
            for b in self._backends.values()
            if b.serves(Role.PRODUCER) and b.dialect is not Dialect.NONE and b.routable
        ]

    def consumers(self) -> list[Backend]:
        return [b for b in self._backends.values() if b.serves(Role.CONSUMER) and b.routable]

    def ready(self) -> bool:
        """A routable consumer exists, and a routable producer too unless none is configured."""
        if not self.consumers():
            return False
        configured = [
            b
            for b in self._backends.values()
            if b.serves(Role.PRODUCER) and b.dialect is not Dialect.NONE and not b.draining
        ]
        return not configured or bool(self.producers())

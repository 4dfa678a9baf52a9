"""Backends and their registry: health, breaker, drain state, in-flight counts and the models
each serves.

A backend's models are its configured ``models`` or, when none are configured, what its
``/v1/models`` last said (:meth:`Backend.learn_models`); until a list is known the backend serves
any model, so a proxy in front of engines that list nothing keeps working as before.

A circuit breaker per backend, fed by request outcomes the backend is to blame for.

The request's lease (:mod:`pdproxy.request.lease`) decides what counts: a success records one; a
failed leg counts only once the same request succeeded elsewhere, or a health check failed too
(:meth:`pdproxy.fleet.health.HealthChecker.confirm`); a 4xx or an abandoned leg is no verdict.

Closed: traffic flows; ``failure_threshold`` consecutive failures open it. Open: no traffic for
``open_s``; then half-open: exactly one probe request is let through. The probe's success closes
the breaker, its failure opens it again. A probe that ends without an outcome (client gone)
frees the probe slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

from pdproxy.errors import ConfigError
from pdproxy.settings import BackendConfig, BreakerSettings, Dialect, Role


@dataclass(frozen=True, slots=True)
class ModelSet:
    """The models a backend serves, and which of them are LoRA adapters of which base."""

    names: frozenset[str]
    adapters: tuple[tuple[str, str], ...]
    """(adapter, base) pairs, sorted."""
    listed: tuple[str, ...]
    """``names`` in the order the backend listed them (which of them fit a budget)."""

    def __init__(self, names: Iterable[str], parents: dict[str, str]) -> None:
        listed = tuple(dict.fromkeys(names))
        object.__setattr__(self, "names", frozenset(listed))
        object.__setattr__(self, "listed", listed)
        pairs = sorted((a, b) for a, b in parents.items() if a in self.names)
        object.__setattr__(self, "adapters", tuple(pairs))


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
        "models",
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
        self.models: ModelSet | None = ModelSet(config.models, {}) if config.models else None
        """What it serves (None: not known yet, so any model)."""

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
    def kv_engine_id(self) -> str | None:
        return self.config.kv_engine_id

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def data_parallel_size(self) -> int:
        return self.config.data_parallel_size

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and not self.removed and self.breaker.allows()

    def serves(self, role: Role) -> bool:
        return self.config.role is role or self.config.role is Role.BOTH

    def serves_model(self, model: str) -> bool:
        """True when it serves ``model`` (a base model or a loaded adapter), or its list is
        not known yet."""
        return self.models is None or model in self.models.names

    def learn_models(self, names: tuple[str, ...], parents: dict[str, str]) -> bool:
        """Its ``/v1/models`` answered ``names`` (``parents``: adapter -> base). Configured
        models win over learned ones. True when the set changed."""
        if self.config.models:
            return False
        learned = ModelSet(names, parents)
        if self.models == learned:
            return False
        self.models = learned
        return True

    def begin(self) -> None:
        """A leg is about to be sent: count it in flight (and as the half-open probe). Called
        only by :class:`pdproxy.request.lease.BackendHold`, which calls :meth:`end` exactly once."""
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
        self.version = 0
        """Moves on every add and remove: what is derived from the set of backends (the model
        catalog's known models) is recomputed when it has moved."""

    def add(self, config: BackendConfig) -> Backend:
        if config.name in self._backends:
            raise ConfigError(f"backend {config.name!r} already exists")
        backend = Backend(config, CircuitBreaker(self._breaker_settings, self._clock))
        self._backends[config.name] = backend
        self.version += 1
        return backend

    def remove(self, name: str) -> Backend:
        backend = self._backends.pop(name, None)
        if backend is None:
            raise KeyError(name)
        backend.removed = True
        self.version += 1
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


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    __slots__ = ("_clock", "_failures", "_opened_at", "_probe_in_flight", "_settings", "_state")

    def __init__(
        self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self._settings.open_s
        ):
            self._state = BreakerState.HALF_OPEN
            self._probe_in_flight = False
        return self._state

    def allows(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._probe_in_flight

    def on_attempt(self) -> None:
        """A request is about to be sent; in half-open it becomes the one probe."""
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def record_success(self) -> None:
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._probe_in_flight = False

    def record_failure(self) -> None:
        self._failures += 1
        threshold = self._settings.failure_threshold
        if self.state is BreakerState.HALF_OPEN or self._failures >= threshold:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_in_flight = False

    def record_abandoned(self) -> None:
        """The attempt ended without an outcome (cancelled): free the probe slot."""
        self._probe_in_flight = False

"""Proxy settings: one pydantic-settings object, passed explicitly.

Sources, highest priority first: keyword arguments (the CLI), environment variables
(``PDPROXY_*``, nested with ``__``, e.g. ``PDPROXY_TIMEOUTS__CONNECT_S=1``), the config file
(YAML or JSON, named by ``config_file``), then defaults. Nothing is read at import time.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from kvtier.events.ranks import offset_endpoint
from pdproxy.errors import ConfigError
from pdproxy.failover_settings import FailoverSettings
from pdproxy.membership.settings import MembershipSettings
from pdproxy.model_settings import ModelsSettings, check_model_name
from pdproxy.origin import base_prefix
from pdproxy.routing.base import Role
from pdproxy.tracing import OtelSettings, otel_settings

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Dialect(StrEnum):
    """How a producer/consumer pair exchanges ``kv_transfer_params``."""

    NIXL = "nixl"
    """vLLM NixlConnector: the producer's returned params go verbatim to the consumer."""
    P2P = "p2p"
    """kvtier workers: ``remote_decoder``/``remote_prefiller`` with a proxy-chosen id."""
    NONE = "none"
    """Aggregated backends: one leg, the client's body unchanged."""


class BackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    url: str
    role: Role
    dialect: Dialect = Dialect.NIXL
    api_key: SecretStr | None = None
    """Sent upstream as ``Authorization: Bearer <key>``; no header when unset."""
    events_endpoint: str | None = None
    """KV events publisher (e.g. ``tcp://host:5557``) for the KV-aware router."""
    events_replay_endpoint: str | None = None
    """The publisher's replay socket (e.g. ``tcp://host:5559``): missed events are asked for
    here. Takes precedence over ``router_options.replay`` for this backend."""
    health_path: str = "/health"
    kv_address: str | None = None
    """``host:port`` this producer announces for KV transfer (the P2P server, or NIXL's side
    channel). A producer answer naming another ``remote_host``/``remote_port`` is refused (the
    attempt fails over, counted in ``pdproxy_kv_address_mismatches``): the consumer would
    connect wherever the answer says. Unset: not checked (the proxy warns at start), i.e. the
    producer is trusted to name itself; set it in production."""
    models: tuple[str, ...] = ()
    """Models (and LoRA adapters) this backend serves; empty: learned from its ``/v1/models``
    (until then it serves any model)."""
    data_parallel_size: int = Field(default=1, ge=1, le=1024)
    """Data-parallel ranks behind this one HTTP endpoint, each with its own KV cache (vLLM's
    ``--data-parallel-size``). Above 1 the router places requests per (backend, rank), legs
    carry ``X-data-parallel-rank``, rank ``r`` publishes KV events on the events (and replay)
    endpoint's port + ``r`` and serves P2P on ``kv_address``'s port + ``r`` (vLLM's
    conventions; :mod:`pdproxy.dp_ranks`)."""
    kv_engine_id: str | None = Field(default=None, min_length=1, max_length=256)
    """The node id this backend's P2P server proves in its handshake. A request sent to pull
    from this backend (``remote_kv_source``) pins it, so the puller refuses any other node at
    ``kv_address``; unset: not pinned."""

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(check_model_name(m) for m in value))

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(f"backend name {value!r} must match {_NAME_RE.pattern}")
        return value

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            # No echo: a URL may carry credentials (user:password@host).
            raise ValueError("backend url must start with http:// or https://")
        base_prefix(value)  # the upstream client must be able to use it as is
        return value.rstrip("/")

    @field_validator("health_path")
    @classmethod
    def _check_health_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"health_path {value!r} must start with '/'")
        return value

    @field_validator("kv_address")
    @classmethod
    def _check_kv_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_address {value!r} must be host:port")
        return value

    @model_validator(mode="after")
    def _rank_ports_fit(self) -> BackendConfig:
        last = self.data_parallel_size - 1
        if self.kv_address is not None and last:
            port = int(self.kv_address.rpartition(":")[2])
            if port + last > 65535:
                raise ValueError("kv_address port + data_parallel_size - 1 exceeds 65535")
        if last:
            for endpoint in (self.events_endpoint, self.events_replay_endpoint):
                offset_endpoint(endpoint, last)  # ValueError: no port to offset by a rank
        return self

    @property
    def kv_host_port(self) -> tuple[str, int] | None:
        """``kv_address`` split (an IPv6 host loses its brackets)."""
        if self.kv_address is None:
            return None
        host, _, port = self.kv_address.rpartition(":")
        return host.strip("[]"), int(port)


class ApiKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: SecretStr
    trusted: bool = False
    """Trusted callers may send their own ``kv_transfer_params``."""


class TimeoutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_s: float = Field(default=3.0, gt=0)
    producer_total_s: float = Field(default=120.0, gt=0)
    consumer_first_byte_s: float = Field(default=300.0, gt=0)
    """Until the consumer's headers (and, for streams, its first chunk) arrive."""
    consumer_idle_s: float = Field(default=60.0, gt=0)
    """Longest silence between two consumer chunks."""
    health_check_s: float = Field(default=2.0, gt=0)
    release_s: float = Field(default=2.0, gt=0)


class UpstreamSettings(BaseModel):
    """The upstream HTTP/1.1 client's limits (every backend gets its own keep-alive pool)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    """Most bytes of a response head, interim (1xx) heads included; trailers get as much."""
    max_header_fields: int = Field(default=100, ge=8)
    """Most header fields in one response head (and in its trailers)."""
    max_answer_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Most bytes of an answer read whole: producer legs, non-stream consumer answers, health
    and control calls. Streamed answers are relayed chunk by chunk and not capped here."""
    idle_s: float = Field(default=4.0, gt=0)
    """A pooled connection idle longer than this is closed instead of reused. Kept below the
    engines' own keep-alive timeout (uvicorn's default is 5 s) so that the proxy rarely writes
    into a connection the server is closing: a POST written there is never resent (the leg
    fails and the request path decides), so that race must stay rare."""
    max_idle: int = Field(default=256, ge=0)
    """Most idle keep-alive connections kept per backend."""


class RetrySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    producer_attempts: int = Field(default=2, ge=1)
    consumer_attempts: int = Field(default=2, ge=1)
    backoff_base_s: float = Field(default=0.01, ge=0)
    backoff_max_s: float = Field(default=0.25, ge=0)
    budget_s: float = Field(default=10.0, gt=0)
    """Most time spent on producer attempts before falling back to the consumer alone."""
    fallback_to_consumer: bool = True
    """The consumer prefills the prompt itself when the producer's KV cannot be used: every
    producer attempt failed, or every consumer leg carrying the KV failed with a server error
    (then once more, without the KV, on the consumer that answered last). False: 502."""


class HealthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    interval_s: float = Field(default=2.0, gt=0)
    healthy_threshold: int = Field(default=2, ge=1)
    unhealthy_threshold: int = Field(default=2, ge=1)


class BreakerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_threshold: int = Field(default=5, ge=1)
    """Consecutive failed requests that open the breaker."""
    open_s: float = Field(default=5.0, gt=0)
    """How long an open breaker refuses traffic before one half-open probe."""


class AdmissionSettings(BaseModel):
    """A request takes its admission slot before its body is read, so at most
    ``max_concurrent`` bodies (each at most ``max_body_bytes``) are ever buffered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent: int = Field(default=1024, ge=1)
    queue_size: int = Field(default=1024, ge=0)
    queue_timeout_s: float = Field(default=10.0, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    """4 MiB: a 1M-token text prompt (~4 bytes a token) or ~600k token ids as JSON; images
    belong in URLs. Bounds the memory one request pins and the CPU its parsing costs."""
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    """Longest time to receive a whole body (4 MiB in 30 s is ~140 KB/s): a slow sender is
    answered 408 and its connection closed, freeing the slot."""
    max_connections: int = Field(default=4096, ge=1)
    """Open client connections (uvicorn's ``limit_concurrency``): beyond it, 503 at once."""


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Reads the YAML/JSON file named by ``config_file``."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self._data = load_config_file(path) if path is not None else {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def load_config_file(path: Path) -> dict[str, Any]:
    """Parse a YAML or JSON config file into a mapping."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except ValueError as exc:  # json's message holds positions only
        raise ConfigError(f"config file {path} does not parse: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} does not parse: {_yaml_problem(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    data.pop("config_file", None)
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's own text quotes the offending line, which may hold a key: position only."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "invalid YAML"
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def validation_error_text(exc: ValidationError) -> str:
    """A settings error without the offending values: pydantic's own text quotes every input,
    and a value in the wrong place or of the wrong type may be a key."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PDPROXY_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    config_file: Path | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: str = "info"

    backends: list[BackendConfig] = Field(default_factory=list)
    router: Literal["round_robin", "least_loaded", "kv"] = "round_robin"
    router_options: dict[str, Any] = Field(default_factory=dict)
    """Free-form options for the chosen router (the KV-aware router validates its own)."""

    api_keys: list[ApiKey] = Field(default_factory=list)
    """Client keys; empty means no client authentication."""
    admin_key: SecretStr | None = None
    """Bearer key for ``/admin``; the admin API is off when unset."""

    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    retries: RetrySettings = Field(default_factory=RetrySettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    membership: MembershipSettings = Field(default_factory=MembershipSettings)
    """Backends found by DNS or announced by workers (``pdproxy.membership``)."""
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    """Many models behind one proxy: per-model router options, adapters, limits."""

    drain_delay_s: float = Field(default=0.0, ge=0)
    """After SIGTERM: seconds with readiness false before the listener closes."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """After SIGTERM: the longest in-flight requests may take to finish."""
    workers: int = Field(default=0, ge=0)
    """``pdproxy serve`` processes on the one port; 0: one per core (see README, "Several
    processes")."""
    models_cache_s: float = Field(default=5.0, ge=0)
    """How long ``GET /v1/models`` answers from its last fan-out to the backends."""
    server_timing: bool = True
    debug_headers: bool = False
    """Answer ``x-pdproxy-debug: 1`` with an ``x-pdproxy-route`` header explaining the routing
    decision. Off by default: the explanation names backends and their load."""
    tracing: OtelSettings = Field(default_factory=OtelSettings)
    """OpenTelemetry tracing, from the standard ``OTEL_*`` variables (:mod:`pdproxy.tracing`);
    off unless an exporter or an OTLP endpoint is set."""
    data_parallel_routing: Literal["auto", "on", "off"] = "auto"
    """Route to each data-parallel rank of a backend with ``data_parallel_size`` > 1 (its own
    residency and load, ``X-data-parallel-rank`` on the legs; :mod:`pdproxy.dp_ranks`).
    ``auto``: on when a configured backend has several ranks (else the router is exactly the
    one without ranks); ``on``: also for backends with several ranks added at run time;
    ``off``: ranks are left to the engine's own balancer (rank-blind, one node per backend)."""

    failover: FailoverSettings = Field(default_factory=FailoverSettings)
    """Mid-stream failover of streamed answers (:mod:`pdproxy.failover`)."""

    _tracing_over_env = field_validator("tracing", mode="before")(otel_settings)

    @model_validator(mode="after")
    def _unique_backend_names(self) -> ProxySettings:
        names = [b.name for b in self.backends]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate backend names: {dupes}")
        cap = self.admission.max_concurrent
        for model in {*self.models.served, "*"}:
            limits = self.models.limits_of(model) if model != "*" else self.models.default_limits
            if limits is not None and limits.max_concurrent + limits.queue_size >= cap:
                raise ValueError(
                    f"models: limits of {model!r} (max_concurrent + queue_size) must stay below "
                    f"admission.max_concurrent ({cap}), or one model can starve the others"
                )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path: Path | None = None
        if isinstance(init_settings, InitSettingsSource):
            raw = init_settings.init_kwargs.get("config_file")
            path = Path(raw) if raw is not None else None
        return (init_settings, env_settings, _ConfigFileSource(settings_cls, path))

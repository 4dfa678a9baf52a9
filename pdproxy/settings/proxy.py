"""Proxy settings: one pydantic-settings object, passed explicitly.

Sources, highest priority first: keyword arguments (the CLI), environment variables
(``PDPROXY_*``, nested with ``__``, e.g. ``PDPROXY_TIMEOUTS__CONNECT_S=1``), the config file
(YAML or JSON, named by ``config_file``), then defaults. Nothing is read at import time.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
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

from pdproxy.errors import ConfigError
from pdproxy.settings.backends import (
    BackendConfig,
    BreakerSettings,
    HealthSettings,
    RetrySettings,
    TimeoutSettings,
    UpstreamSettings,
)
from pdproxy.settings.membership import MembershipSettings
from pdproxy.settings.models import ModelsSettings
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.tracing import OtelSettings, otel_settings


class ApiKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: SecretStr
    trusted: bool = False
    """Trusted callers may send their own ``kv_transfer_params``."""
    tenant: str | None = Field(default=None, min_length=1, max_length=256)
    """The tenant this key belongs to: keys naming the same tenant share its prefix cache.
    Unset: the key is a tenant of its own (see ``docs/security.md``, "Tenants")."""
    see_cached_tokens: bool = False
    """Answers to this key show the engine's ``cached_tokens``; to any other key they show 0,
    so that a key cannot learn which prompts its own tenant's other keys sent."""
    ttft_class: str | None = Field(default=None, min_length=1, max_length=64)
    """The TTFT class of this key's requests (``router_options.ttft.classes``: ``interactive``,
    ``batch``...); unset, or a name the model's router does not know: its ``default_class``."""


class TenantSettings(BaseModel):
    """Prefix-cache isolation between tenants (keys, or keys sharing a ``tenant`` name). Without
    ``api_keys`` every client is one tenant and nothing here applies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share_prefixes: bool = False
    """Let every tenant's prompts share cache entries (the engines' default): faster for common
    system prompts, but each tenant's ``cached_tokens`` and latency then tell which prompts
    other tenants sent. Off: each request's ``cache_salt`` is derived from its tenant."""
    salt_secret: SecretStr | None = Field(default=None, min_length=16)
    """Key of the HMAC that derives each tenant's ``cache_salt``. Unset: a random one is made at
    start (shared by ``serve --workers N``); set it when several proxies serve one fleet, or
    their tenants' caches are split between them (a restart with a new one cools caches)."""

    def with_secret(self) -> TenantSettings:
        """These settings with ``salt_secret`` set (a random one made now when unset)."""
        if self.salt_secret is not None:
            return self
        return self.model_copy(update={"salt_secret": SecretStr(secrets.token_hex(32))})


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
    """Client requests in progress (a complete head received, the answer not finished): beyond
    it, 503 at once. Connections waiting for a head do not count: see ``head_timeout_s`` and
    ``max_waiting_connections``."""
    head_timeout_s: float = Field(default=5.0, gt=0)
    """A connection must send a complete request head within this long of opening, or of its
    previous answer (so it also bounds keep-alive idleness, as uvicorn's 5 s timeout does);
    otherwise it is closed (408 when it had sent part of one)."""
    max_head_bytes: int = Field(default=64 * 1024, ge=1024)
    """Longest request head (request line and headers): past it, 431 and the connection closed
    (the server would otherwise buffer an endless head)."""
    max_waiting_connections: int = Field(default=1024, ge=1)
    """Connections open without a request in progress (just accepted, sending a head, or kept
    alive between requests); one more closes the oldest of them."""
    max_waiting_per_source: int = Field(default=128, ge=0)
    """Waiting connections per client address; one more closes that address's oldest. Behind a
    load balancer all clients share its address: set at least the balancer's idle connection
    pool to this proxy, or 0 (no per-source cap)."""


class FailoverSettings(BaseModel):
    """``max_migrations`` 0 (the default) keeps today's behaviour: a consumer failing after the
    first byte ends the stream with an error event. 1 or 2: the stream moves to another consumer
    that many times at most."""

    max_migrations: int = Field(default=0, ge=0, le=2)
    token_ids: bool = True
    """Ask a migratable stream's consumer for token ids (``return_token_ids``: vLLM, the
    reference worker) so a continuation resumes from the ids the client received, exact by
    construction; off for an engine that refuses the field (continuations then resume from
    text)."""


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


def parse_router_options(options: Mapping[str, Any] | KvRouterSettings) -> KvRouterSettings:
    """``options`` as the KV router's settings: typed ones as they are; a mapping (settings
    copied with ``model_copy``, which skips validation; a script's own dict) validated, a
    :class:`ConfigError` naming the key path when it is not valid."""
    if isinstance(options, KvRouterSettings):
        return options
    try:
        return KvRouterSettings.model_validate(dict(options))
    except ValidationError as exc:
        raise ConfigError(f"invalid KV router options: {validation_error_text(exc)}") from exc


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
    router_options: KvRouterSettings = Field(default_factory=KvRouterSettings)
    """Options of the KV-aware router (:mod:`pdproxy.settings.routing`), validated here like
    every other key; the load-only routers have none."""

    api_keys: list[ApiKey] = Field(default_factory=list)
    """Client keys; empty means no client authentication (and one tenant for everyone)."""
    tenants: TenantSettings = Field(default_factory=TenantSettings)
    """Prefix-cache isolation between the tenants of ``api_keys``."""
    admin_key: SecretStr | None = None
    """Bearer key for ``/admin``; the admin API is off when unset."""

    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    retries: RetrySettings = Field(default_factory=RetrySettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    membership: MembershipSettings = Field(default_factory=MembershipSettings)
    """Backends found by DNS or announced by workers (``pdproxy.fleet.membership``)."""
    models: ModelsSettings = Field(default_factory=ModelsSettings)
    """Many models behind one proxy: per-model router options, adapters, limits."""

    drain_delay_s: float = Field(default=0.0, ge=0)
    """After SIGTERM: seconds with readiness false before the listener closes."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """After SIGTERM: the longest in-flight requests may take to finish."""
    workers: int = Field(default=0, ge=0)
    """``pdproxy serve`` processes on the one port; 0: one per core (see README, "Several
    processes")."""
    metrics_cache_s: float = Field(default=1.0, ge=0)
    """With several processes: how long ``GET /metrics`` answers from its last merge of every
    process's metrics (one fan-out and merge per interval per process, however often it is
    scraped; 0: a merge per scrape, concurrent scrapes still share one)."""
    models_cache_s: float = Field(default=5.0, ge=0)
    """How long ``GET /v1/models`` answers from its last fan-out to the backends."""
    server_timing: bool = True
    debug_headers: bool = False
    """Answer ``x-pdproxy-debug: 1`` with an ``x-pdproxy-route`` header explaining the routing
    decision. Off by default: the explanation names backends and their load."""
    tracing: OtelSettings = Field(default_factory=OtelSettings)
    """OpenTelemetry tracing, from the standard ``OTEL_*`` variables
    (:mod:`pdproxy.settings.tracing`); off unless an exporter or an OTLP endpoint is set."""
    data_parallel_routing: Literal["auto", "on", "off"] = "auto"
    """Route to each data-parallel rank of a backend with ``data_parallel_size`` > 1 (its own
    residency and load, ``X-data-parallel-rank`` on the legs; :mod:`pdproxy.fleet.dp_ranks`).
    ``auto``: on when a configured backend has several ranks (else the router is exactly the
    one without ranks); ``on``: also for backends with several ranks added at run time;
    ``off``: ranks are left to the engine's own balancer (rank-blind, one node per backend)."""

    failover: FailoverSettings = Field(default_factory=FailoverSettings)
    """Mid-stream failover of streamed answers (:mod:`pdproxy.request.failover`)."""

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
        classes = set(self.router_options.ttft.classes)
        for served in self.models.served.values():
            if "ttft" in served.router_options.model_fields_set:
                classes |= set(served.router_options.ttft.classes)
        unknown = sorted({k.ttft_class for k in self.api_keys if k.ttft_class} - classes)
        if unknown:
            raise ValueError(f"api_keys name TTFT classes no router_options.ttft has: {unknown}")
        listening = [b.name for b in self.backends if b.events_listen]
        if listening and self.workers != 1:
            # One process can listen on a port; the others would follow no events at all.
            raise ValueError(f"events_listen (backends {listening}) needs workers: 1")
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

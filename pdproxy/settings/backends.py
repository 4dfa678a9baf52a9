"""Where the backends are and how to talk to them: roles, dialects, each backend's entry,
timeouts, the upstream client's limits, retries, health checks and breakers."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from kvtier.events.ranks import offset_endpoint
from pdproxy.origin import base_prefix
from pdproxy.settings.models import check_model_name


class Role(StrEnum):
    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"


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
    events_listen: bool = False
    """The proxy listens at ``events_endpoint`` (``tcp://host:port``, and port + ``r`` for rank
    ``r``) and the engine connects to it, as vLLM's publisher does for a concrete address: a DP
    vLLM 0.32 can publish privately only so (it refuses ``ipc://`` for rank 1 and up and binds
    only ``tcp://*``). A listener: whoever reaches it can publish events, which steer routing
    but cannot fail a request; bind loopback or a private network (docs/security.md). One
    process can listen on a port: it needs the proxy's ``workers: 1``."""
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
    conventions; :mod:`pdproxy.fleet.dp_ranks`)."""
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
        if self.events_listen and not (self.events_endpoint or "").startswith("tcp://"):
            raise ValueError("events_listen needs a tcp:// events_endpoint to listen at")
        return self

    @property
    def kv_host_port(self) -> tuple[str, int] | None:
        """``kv_address`` split (an IPv6 host loses its brackets)."""
        if self.kv_address is None:
            return None
        host, _, port = self.kv_address.rpartition(":")
        return host.strip("[]"), int(port)


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

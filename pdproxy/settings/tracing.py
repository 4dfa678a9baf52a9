"""OpenTelemetry tracing settings (the standard ``OTEL_*`` variables) and the switch.

Tracing is off unless asked for, and off costs nothing:
:func:`pdproxy.app.build_request_tracer` returns
None, the request path then only forwards the client's validated trace headers
(:mod:`pdproxy.observe.trace_context`), and no OpenTelemetry SDK module is imported. It is on when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp`` or ``console``), or when it is unset and
an OTLP endpoint is (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turns it off. (The specification's
default exporter is ``otlp``; a proxy that nobody asked to trace should not post spans to
``localhost:4318``, hence the endpoint rule.) The spans themselves are in
:mod:`pdproxy.request.trace`, which needs the ``pdproxy[otel]`` extra.

The variables are read when :class:`OtelSettings` is built, as a field of
:class:`~pdproxy.settings.ProxySettings`, never at import; the config file's ``tracing:`` map
and keyword arguments take precedence over the environment, field by field.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import unquote

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdproxy.errors import ConfigError

Exporter = Literal["otlp", "console", "none"]
Sampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]
OTLP_HTTP_PORT = 4318


class OtelSettings(BaseSettings):
    """The ``OTEL_*`` variables pdproxy honours (names as in the OpenTelemetry specification)."""

    model_config = SettingsConfigDict(env_prefix="OTEL_", extra="forbid", frozen=True)

    sdk_disabled: bool = False
    traces_exporter: Exporter | None = None
    """Unset: ``otlp`` when an OTLP endpoint is set, else tracing is off."""
    service_name: str = "pdproxy"
    resource_attributes: str = ""
    """``key=value,key=value`` (values percent-encoded), added to the spans' resource."""
    exporter_otlp_endpoint: str | None = None
    """Base URL; traces go to ``<endpoint>/v1/traces``."""
    exporter_otlp_traces_endpoint: str | None = None
    """Full URL of the traces endpoint; takes precedence over the base endpoint."""
    exporter_otlp_protocol: str = "http/protobuf"
    exporter_otlp_traces_protocol: str | None = None
    exporter_otlp_headers: SecretStr | None = None
    """``key=value,...`` sent with every export (often a credential, hence secret)."""
    exporter_otlp_traces_headers: SecretStr | None = None
    exporter_otlp_compression: Literal["none", "gzip", "deflate"] = "none"
    exporter_otlp_timeout: int = Field(default=10_000, gt=0)
    """Milliseconds per export request."""
    exporter_otlp_traces_timeout: int | None = Field(default=None, gt=0)
    traces_sampler: Sampler = "parentbased_always_on"
    traces_sampler_arg: float | None = Field(default=None, ge=0, le=1)
    """The ratio for the ``*traceidratio`` samplers (default 1.0)."""
    bsp_schedule_delay: int = Field(default=5000, ge=0)
    """Milliseconds between two exports of the batch span processor."""
    bsp_max_queue_size: int = Field(default=2048, gt=0)
    """Spans kept waiting for export; more are dropped (the request never waits)."""
    bsp_max_export_batch_size: int = Field(default=512, gt=0)
    bsp_export_timeout: int = Field(default=30_000, gt=0)

    @field_validator("exporter_otlp_protocol", "exporter_otlp_traces_protocol")
    @classmethod
    def _http_only(cls, value: str | None) -> str | None:
        if value is not None and value != "http/protobuf":
            raise ValueError(
                f"OTLP protocol {value!r} is not supported; pdproxy exports http/protobuf"
            )
        return value

    @field_validator("exporter_otlp_headers", "exporter_otlp_traces_headers")
    @classmethod
    def _key_value_headers(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            parse_key_values(value.get_secret_value(), "headers")
        return value

    @field_validator("resource_attributes")
    @classmethod
    def _key_value_resource(cls, value: str) -> str:
        parse_key_values(value, "resource attributes")
        return value

    @property
    def exporter(self) -> Exporter:
        """The exporter in effect after the rules in the module docstring."""
        if self.sdk_disabled:
            return "none"
        if self.traces_exporter is not None:
            return self.traces_exporter
        if self.exporter_otlp_endpoint or self.exporter_otlp_traces_endpoint:
            return "otlp"
        return "none"

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"

    def traces_endpoint(self) -> str:
        if self.exporter_otlp_traces_endpoint:
            return self.exporter_otlp_traces_endpoint
        base = self.exporter_otlp_endpoint or f"http://localhost:{OTLP_HTTP_PORT}"
        return base.rstrip("/") + "/v1/traces"

    def export_headers(self) -> dict[str, str]:
        secret = self.exporter_otlp_traces_headers or self.exporter_otlp_headers
        return parse_key_values(secret.get_secret_value(), "headers") if secret else {}

    def export_timeout_s(self) -> float:
        return (self.exporter_otlp_traces_timeout or self.exporter_otlp_timeout) / 1000

    def resource(self) -> dict[str, str]:
        """Resource attributes: ``OTEL_RESOURCE_ATTRIBUTES`` with ``service.name`` from
        ``OTEL_SERVICE_NAME`` (which wins, as the specification says)."""
        out = parse_key_values(self.resource_attributes, "resource attributes")
        out["service.name"] = self.service_name
        return out


def parse_key_values(text: str, what: str) -> dict[str, str]:
    """``k=v,k2=v2`` with percent-encoded values (the OTEL_* list format)."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"OpenTelemetry {what}: {item.strip()!r} is not key=value")
        out[unquote(key.strip())] = unquote(value.strip())
    return out


def otel_settings(value: Any) -> Any:
    """Validator helper for the ``tracing`` field: a mapping from the config file or keyword
    arguments is layered over the ``OTEL_*`` environment instead of replacing it."""
    if isinstance(value, dict):
        return OtelSettings(**value)
    return value

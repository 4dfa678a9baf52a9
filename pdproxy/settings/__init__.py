"""The proxy's settings: one typed tree, validated when the config is loaded.

Rule 1: nothing here imports the runtime: only pydantic, :mod:`pdproxy.errors`,
:mod:`pdproxy.origin` (URL parsing) and the other settings modules, so every part of the
proxy can import its settings without a cycle.
Rule 2: a value that passed validation is usable as it is: checks live on the fields, and an
error names the key path (``timeouts.connect_s: ...``), never the value (it may be a secret).

:class:`ProxySettings` is the root; ``backends`` (where they are and how to reach them),
``models``, ``membership``, ``tracing`` and ``router_options`` (:mod:`~pdproxy.settings.routing`,
its scorers' sections in :mod:`~pdproxy.settings.scorers`) are its branches, each in a module of
its own.
"""

from pdproxy.settings.backends import (
    BackendConfig,
    BreakerSettings,
    Dialect,
    HealthSettings,
    RetrySettings,
    Role,
    TimeoutSettings,
    UpstreamSettings,
)
from pdproxy.settings.proxy import (
    AdmissionSettings,
    ApiKey,
    FailoverSettings,
    ProxySettings,
    TenantSettings,
    load_config_file,
    parse_router_options,
    validation_error_text,
)
from pdproxy.settings.routing import KvRouterSettings

__all__ = [
    "AdmissionSettings",
    "ApiKey",
    "BackendConfig",
    "BreakerSettings",
    "Dialect",
    "FailoverSettings",
    "HealthSettings",
    "KvRouterSettings",
    "ProxySettings",
    "RetrySettings",
    "Role",
    "TenantSettings",
    "TimeoutSettings",
    "UpstreamSettings",
    "load_config_file",
    "parse_router_options",
    "validation_error_text",
]

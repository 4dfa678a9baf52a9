"""Typed errors of the vLLM connector.

Hierarchy::

    KvtierError
    └── KvtierConnectorError          the connector cannot run as configured
        └── KvtierConnectorConfigError bad kv_connector_extra_config, or a vLLM setup the
                                       connector does not support (several KV-cache groups,
                                       a producer without a fixed P2P port)

Transfer failures are never raised to vLLM: a short or failed fetch is reported as load errors
(vLLM recomputes from the first missing block).
"""

from __future__ import annotations

from kvtier.errors import KvtierError


class KvtierConnectorError(KvtierError):
    """The connector cannot run as configured."""


class KvtierConnectorConfigError(KvtierConnectorError, ValueError):
    """Bad ``kv_connector_extra_config`` or an unsupported vLLM setup."""
